"""The problem families of the ``explore`` task: the data each puts in the kernel, the question, the answer.

A family draws a problem's parameters (the data itself and what the question asks about, all JSON), writes the
Python source that loads the data into the kernel (``setup``), states the question (naming what is loaded, never
showing it), computes the answer on the host, and gives a reference solution: the lines a person would type at the
REPL (the tests run them through real kernels). Levels: 1, a few lines with the names given (small data); 2, a
filter, a sum or a search over more data; 3, something must be looked at first (unknown keys, columns, format or
shape).

The answer is never part of what a setup loads. Where it is computed (a count, a sum, f(1000)), a draw whose answer
equals a value of the data is rejected, so a scan of the kernel's namespace for the answer finds nothing; where it is
by nature a value of the data (a lookup, an arg-max: ``LOOKUP``), it is only inside the data the question is about.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

CITIES = ("Lyon", "Paris", "Nantes", "Lille", "Nice", "Rennes", "Dijon", "Metz")
PRODUCTS = ("pen", "cup", "lamp", "desk", "book", "mug", "fan", "clock")
STATIONS = ("north", "south", "east", "west", "hill")
SERVICES = ("api", "db", "cache", "worker", "auth", "search", "mail", "queue")
USERS = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy")
PATHS = ("/", "/login", "/api/items", "/api/users", "/static/app.js", "/health")


@dataclass(frozen=True)
class Family:
    """One family: ``draw(rng, level)`` -> params; the rest are functions of the params."""

    draw: Callable[[random.Random, int], dict[str, Any]]
    setup: Callable[[dict[str, Any]], str]
    question: Callable[[dict[str, Any]], str]
    solve: Callable[[dict[str, Any]], int | str]
    reference: Callable[[dict[str, Any]], list[str]]
    """REPL lines that solve the problem (a blank string closes a block), the last one a ``submit``."""
    variable: str
    """The name the data is loaded under (what the header names)."""
    data_key: str
    """The params field holding the data the setup loads (for the check that a computed answer is not in it)."""
    lookup: tuple[int, ...] = ()
    """Levels whose answer is by nature a value of the data (a lookup, an arg-max)."""


def scalars(obj: Any) -> Iterator[Any]:
    """Every int, float and str inside nested dicts / lists (keys included): the data's values."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from scalars(k)
            yield from scalars(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from scalars(v)
    elif isinstance(obj, int | float | str) and not isinstance(obj, bool):
        yield obj


# ---------------------------------------------------------------- records: a list of dicts


RECORD_KEYS = {1: ("id", "city", "amount"), 2: ("id", "city", "amount"), 3: ("order_ref", "ship_to", "total_eur")}


def _records_draw(rng: random.Random, level: int) -> dict[str, Any]:
    key_id, key_city, key_amount = RECORD_KEYS[level]
    n = rng.randint(8, 12) if level == 1 else rng.randint(25, 40)
    cities = rng.sample(CITIES, 3 if level == 1 else 5)
    rows = [{key_id: f"o{rng.randint(100, 999)}", key_city: rng.choice(cities), key_amount: rng.randint(10, 200)}
            for _ in range(n)]
    if level == 3:
        for r in rows:
            r["n_items"] = rng.randint(1, 9)
    return {"level": level, "rows": rows, "city": rng.choice(cities), "over": rng.choice((50, 80, 100))}


def _records_solve(p: dict[str, Any]) -> int | str:
    rows, level = p["rows"], p["level"]
    _, key_city, key_amount = RECORD_KEYS[level]
    if level == 1:
        return sum(r[key_city] == p["city"] for r in rows)
    if level == 2:
        return sum(r[key_amount] for r in rows if r[key_city] == p["city"] and r[key_amount] > p["over"])
    totals: dict[str, int] = {}
    for r in rows:
        totals[r[key_city]] = totals.get(r[key_city], 0) + r[key_amount]
    ranked = sorted(totals.values(), reverse=True)
    return "" if len(ranked) > 1 and ranked[0] == ranked[1] else max(totals, key=totals.__getitem__)  # "": a tie


def _records_question(p: dict[str, Any]) -> str:
    level = p["level"]
    if level == 1:
        return (f"`orders` is a list of dicts with the keys 'id', 'city' and 'amount'. How many orders are from "
                f"{p['city']}?")
    if level == 2:
        return (f"`orders` is a list of dicts with the keys 'id', 'city' and 'amount'. What is the total amount of "
                f"the orders from {p['city']} whose amount is over {p['over']}?")
    return ("`orders` is a list of dicts, one per order; their keys are not given (look at one). Which city do the "
            "orders with the largest total amount go to? Submit the city's name as a string.")


def _records_reference(p: dict[str, Any]) -> list[str]:
    level = p["level"]
    if level == 1:
        return ["orders[0]", f"n = sum(1 for o in orders if o['city'] == {p['city']!r})", "submit(n)"]
    if level == 2:
        return [f"total = sum(o['amount'] for o in orders if o['city'] == {p['city']!r} and o['amount'] > "
                f"{p['over']})", "submit(total)"]
    return ["orders[0]", "totals = {}", "for o in orders:", "    totals[o['ship_to']] = totals.get(o['ship_to'], 0) + "
            "o['total_eur']", "", "submit(max(totals, key=totals.get))"]


RECORDS = Family(draw=_records_draw, setup=lambda p: f"orders = {p['rows']!r}\n", question=_records_question,
                 solve=_records_solve, reference=_records_reference, variable="orders", data_key="rows", lookup=(3,))


# ---------------------------------------------------------------- a pandas DataFrame `df`


def _df_draw(rng: random.Random, level: int) -> dict[str, Any]:
    if level < 3:
        n = rng.randint(6, 10) if level == 1 else rng.randint(20, 30)
        products = rng.sample(PRODUCTS, 4)
        cols = {"product": [rng.choice(products) for _ in range(n)],
                "price": [rng.randint(2, 40) for _ in range(n)], "units": [rng.randint(1, 30) for _ in range(n)]}
        return {"level": level, "columns": cols, "product": rng.choice(cols["product"])}
    n = rng.randint(25, 40)
    stations = rng.sample(STATIONS, 3)
    cols = {"day": [f"2024-06-{1 + i // 3:02d}" for i in range(n)], "station": [stations[i % 3] for i in range(n)],
            "temp_c": [rng.randint(8, 34) for _ in range(n)], "rain_mm": [rng.choice((0, 0, 1, 3, 7, 12, 25))
                                                                         for _ in range(n)]}
    return {"level": 3, "columns": cols, "station": rng.choice(stations), "warmer": rng.choice((18, 20, 22, 25))}


def _df_solve(p: dict[str, Any]) -> int:
    c = p["columns"]
    if p["level"] == 1:
        return sum(c["units"])
    if p["level"] == 2:
        return sum(pr * u for name, pr, u in zip(c["product"], c["price"], c["units"]) if name == p["product"])
    return sum(r for s, t, r in zip(c["station"], c["temp_c"], c["rain_mm"]) if s == p["station"] and t > p["warmer"])


def _df_question(p: dict[str, Any]) -> str:
    if p["level"] == 1:
        return ("`df` is a pandas DataFrame with the columns 'product', 'price' and 'units'. What is the total of "
                "'units'?")
    if p["level"] == 2:
        return ("`df` is a pandas DataFrame with the columns 'product', 'price' and 'units'. What is the revenue "
                f"(price times units, summed over its rows) of the product {p['product']!r}?")
    return ("`df` is a pandas DataFrame of daily weather readings at a few stations (its columns are not given: look "
            f"at them). What is the total rainfall in mm at the station {p['station']!r} on the days when it was "
            f"warmer than {p['warmer']} degrees C?")


def _df_reference(p: dict[str, Any]) -> list[str]:
    if p["level"] == 1:
        return ["df.head()", "submit(int(df['units'].sum()))"]
    if p["level"] == 2:
        return [f"rows = df[df['product'] == {p['product']!r}]", "submit(int((rows['price'] * rows['units']).sum()))"]
    return ["df.columns", f"sel = df[(df['station'] == {p['station']!r}) & (df['temp_c'] > {p['warmer']})]",
            "submit(int(sel['rain_mm'].sum()))"]


DATAFRAME = Family(draw=_df_draw, setup=lambda p: f"import pandas as pd\ndf = pd.DataFrame({p['columns']!r})\n",
                   question=_df_question, solve=_df_solve, reference=_df_reference, variable="df", data_key="columns")


# ---------------------------------------------------------------- a black-box function `f`


def _f_draw(rng: random.Random, level: int) -> dict[str, Any]:
    if level == 1:
        coef = [rng.randint(-9, 9), rng.randint(1, 9)] + ([rng.randint(1, 3)] if rng.random() < 0.5 else [])
        return {"level": 1, "spec": {"kind": "poly", "c": coef}, "n": rng.randint(10, 30)}
    if level == 2:
        if rng.random() < 0.5:
            spec = {"kind": "poly", "c": [rng.randint(-20, 20), rng.randint(1, 9), rng.randint(1, 5)]}
        else:
            at = rng.randint(5, 40)
            spec = {"kind": "piecewise", "at": at, "left": [rng.randint(0, 30), rng.randint(1, 5)],
                    "right": [0, rng.randint(6, 20)]}
            spec["right"][0] = _poly(spec["left"], at) - spec["right"][1] * at + rng.randint(0, 9)  # still rising
        return {"level": 2, "spec": spec, "above": rng.randint(500, 20_000)}
    degree = rng.choice((2, 3))
    coef = [rng.randint(-9, 9) for _ in range(degree)] + [rng.choice((-3, -2, -1, 1, 2, 3))]
    return {"level": 3, "spec": {"kind": "poly", "c": coef, "lo": 0, "hi": 10}}


def _poly(c: list[int], x: int) -> int:
    return sum(ci * x**i for i, ci in enumerate(c))


def f_value(spec: dict[str, Any], x: int) -> int:
    """The hidden function, on the host (the kernel's copy evaluates the same spec)."""
    if spec["kind"] == "poly":
        return _poly(spec["c"], x)
    return _poly(spec["left"] if x < spec["at"] else spec["right"], x)


def _f_solve(p: dict[str, Any]) -> int:
    spec = p["spec"]
    if p["level"] == 1:
        return sum(f_value(spec, x) for x in range(1, p["n"] + 1))
    if p["level"] == 2:
        x = 1
        while f_value(spec, x) <= p["above"]:
            x += 1
        return x
    return f_value(spec, 1000)


def _f_question(p: dict[str, Any]) -> str:
    if p["level"] == 1:
        return f"`f` is a function of one integer (its code is hidden). What is f(1) + f(2) + ... + f({p['n']})?"
    if p["level"] == 2:
        return (f"`f` is an increasing function of one integer (its code is hidden). What is the smallest positive "
                f"integer x such that f(x) > {p['above']}?")
    return ("`f` is a polynomial of small degree with integer coefficients (its code is hidden), but it only accepts "
            "the integers 0 to 10 (anything else raises ValueError). What is f(1000)?")


def _f_reference(p: dict[str, Any]) -> list[str]:
    if p["level"] == 1:
        return ["f(1), f(2)", f"submit(sum(f(x) for x in range(1, {p['n'] + 1})))"]
    if p["level"] == 2:
        return ["x = 1", f"while f(x) <= {p['above']}:", "    x += 1", "", "submit(x)"]
    return ["ys = [f(x) for x in range(11)]", "import math", "coef, row = [], ys",
            "while row: coef.append(row[0]); row = [b - a for a, b in zip(row, row[1:])]", "",
            "submit(sum(math.comb(1000, k) * d for k, d in enumerate(coef)))"]


_F_SOURCE = '''def _hide(blob, key):
    def f(x):
        import json
        spec = json.loads(bytes(b ^ key[i % len(key)] for i, b in enumerate(blob)))
        if type(x) is not int:
            raise TypeError("f() takes an int")
        if "lo" in spec and not spec["lo"] <= x <= spec["hi"]:
            raise ValueError(f"f() accepts only the integers {{spec['lo']}} to {{spec['hi']}}")
        if spec["kind"] == "piecewise":
            c = spec["left"] if x < spec["at"] else spec["right"]
        else:
            c = spec["c"]
        return sum(ci * x ** i for i, ci in enumerate(c))
    return f
f = _hide(bytes.fromhex({blob!r}), bytes.fromhex({key!r}))
del _hide
'''


def _f_setup(p: dict[str, Any]) -> str:
    """``f`` in the kernel: a closure over the spec's JSON, XORed with a key, decoded at each call (so neither the
    source, nor ``f.__code__.co_consts``, nor the closure's cells hold a coefficient). Reading the bytecode and
    decoding by hand would still work: hidden from casual looks and getsource, not from a determined reverser."""
    raw = json.dumps(p["spec"]).encode()
    key = random.Random(raw).randbytes(16)
    blob = bytes(b ^ key[i % len(key)] for i, b in enumerate(raw))
    return _F_SOURCE.format(blob=blob.hex(), key=key.hex())


BLACKBOX = Family(draw=_f_draw, setup=_f_setup, question=_f_question, solve=_f_solve, reference=_f_reference,
                  variable="f", data_key="spec")


# ---------------------------------------------------------------- a nested config dict


def _config_draw(rng: random.Random, level: int) -> dict[str, Any]:
    services = {name: {"image": f"{name}:{rng.randint(1, 9)}.{rng.randint(0, 20)}", "port": rng.randint(1024, 9999),
                       "enabled": rng.random() < 0.6, "replicas": rng.randint(1, 9),
                       "env": {"LOG_LEVEL": rng.choice(("info", "debug", "warn"))}}
                for name in rng.sample(SERVICES, rng.randint(3, 4) if level == 1 else rng.randint(5, 8))}
    config: dict[str, Any] = {"version": rng.randint(2, 4), "region": rng.choice(("eu-west", "us-east", "ap-south")),
                              "services": services}
    if level == 3:
        top = rng.choice(("clusters", "zones", "datacenters"))
        config[top] = [{"name": f"{top[0]}{i}",
                        "nodes": [{"id": f"n{i}{j}", "disk_gb": rng.choice((64, 128, 256, 512))}
                                  for j in range(rng.randint(2, 4))]}
                       for i in range(rng.randint(2, 4))]
        config.pop("services")
        return {"level": 3, "config": config, "top": top}
    return {"level": level, "config": config, "service": rng.choice(sorted(services))}


def _config_solve(p: dict[str, Any]) -> int:
    c = p["config"]
    if p["level"] == 1:
        return c["services"][p["service"]]["port"]
    if p["level"] == 2:
        return sum(s["replicas"] for s in c["services"].values() if s["enabled"])
    return sum(n["disk_gb"] for group in c[p["top"]] for n in group["nodes"])


def _config_question(p: dict[str, Any]) -> str:
    if p["level"] == 1:
        return (f"`config` is a nested dict; its services are in config['services']. What is the port of "
                f"{p['service']!r}?")
    if p["level"] == 2:
        return ("`config` is a nested dict; its services are in config['services']. What is the total number of "
                "replicas of the services that are enabled?")
    return ("`config` is a nested structure of dicts and lists (its layout is not given: look at it). It lists "
            "machines ('nodes'), each with a 'disk_gb'. What is the total disk_gb of all the nodes?")


def _config_reference(p: dict[str, Any]) -> list[str]:
    if p["level"] == 1:
        return ["config['services'].keys()", f"submit(config['services'][{p['service']!r}]['port'])"]
    if p["level"] == 2:
        return ["submit(sum(s['replicas'] for s in config['services'].values() if s['enabled']))"]
    return ["config.keys()", f"submit(sum(n['disk_gb'] for g in config[{p['top']!r}] for n in g['nodes']))"]


CONFIG = Family(draw=_config_draw, setup=lambda p: f"config = {p['config']!r}\n", question=_config_question,
                solve=_config_solve, reference=_config_reference, variable="config", data_key="config", lookup=(1,))


# ---------------------------------------------------------------- a text blob: a log


LEVELS_OF_LOG = ("INFO", "INFO", "INFO", "WARN", "ERROR")


def _log_draw(rng: random.Random, level: int) -> dict[str, Any]:
    n = rng.randint(8, 14) if level == 1 else rng.randint(25, 40)
    lines = []
    for i in range(n):
        stamp = f"2024-05-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{i % 60:02d}"
        if level == 1:
            lines.append(f"{stamp} {rng.choice(LEVELS_OF_LOG)} {rng.choice(SERVICES)}: event {rng.randint(1, 999)}")
        elif level == 2:
            status = rng.choice((200, 200, 200, 404, 500))
            lines.append(f"{stamp} GET {rng.choice(PATHS)} status={status} bytes={rng.randint(100, 9000)}")
        else:
            ok = rng.random() < 0.7
            lines.append(f"{stamp.replace(' ', 'T')} auth user={rng.choice(USERS)} result={'OK' if ok else 'FAIL'} "
                         f"src=10.0.{rng.randint(0, 9)}.{rng.randint(1, 254)}")
    return {"level": level, "lines": lines, "status": 500}


def _log_fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def _log_solve(p: dict[str, Any]) -> int:
    if p["level"] == 1:
        return sum(line.split()[2] == "ERROR" for line in p["lines"])
    if p["level"] == 2:
        return sum(int(f["bytes"]) for f in map(_log_fields, p["lines"]) if f["status"] == str(p["status"]))
    return len({f["user"] for f in map(_log_fields, p["lines"]) if f["result"] == "FAIL"})


def _log_question(p: dict[str, Any]) -> str:
    if p["level"] == 1:
        return ("`log` is a str holding a server log, one event per line, such as '2024-05-03 14:02:11 INFO db: event "
                "17'. How many lines have the level ERROR?")
    if p["level"] == 2:
        return ("`log` is a str holding a web server's access log, one request per line with its status= and "
                f"bytes=. What is the total of the bytes of the requests with status {p['status']}?")
    return ("`log` is a str holding a server's login events, one per line (the format is not given: look at it). How "
            "many distinct users had at least one failed login?")


def _log_reference(p: dict[str, Any]) -> list[str]:
    if p["level"] == 1:
        return ["lines = log.splitlines()", "submit(sum(line.split()[2] == 'ERROR' for line in lines))"]
    if p["level"] == 2:
        return ["log.splitlines()[0]", "total = 0", "for line in log.splitlines():",
                "    f = dict(p.split('=') for p in line.split() if '=' in p)",
                f"    if f['status'] == '{p['status']}': total += int(f['bytes'])", "", "submit(total)"]
    return ["log.splitlines()[:2]", "failed = set()", "for line in log.splitlines():",
            "    if 'result=FAIL' in line: failed.add(line.split('user=')[1].split()[0])", "",
            "submit(len(failed))"]


LOG = Family(draw=_log_draw, setup=lambda p: f"log = {chr(10).join(p['lines'])!r}\n", question=_log_question,
             solve=_log_solve, reference=_log_reference, variable="log", data_key="lines")


FAMILIES: dict[str, Family] = {"records": RECORDS, "dataframe": DATAFRAME, "blackbox": BLACKBOX, "config": CONFIG,
                               "log": LOG}
"""The families by name, in the order problems cycle through them."""
