"""Tasks: a header from a dataset row, the tools injected into the kernel, and an answer check.

``load_task("arithmetic", level=3)``, ``load_task("programs", level=2)``, ``load_task("explore", level=1)``,
``load_task("gsm8k", data="path/to/dir")``, ``load_task("dataset", data="problems.jsonl", columns={...},
checker="exact")`` or ``load_task("pkg.mod:MyTask")``; ``task_from_config(cfg)`` the one a ``Config`` names.
"""

from replrl.tasks.arithmetic import ARITHMETIC_HEADER, ArithmeticTask
from replrl.tasks.base import BUILTIN_TASKS, Task, TaskError, TaskWithSetup, load_task, task_from_config
from replrl.tasks.dataset import DATASET_INSTRUCTIONS, DatasetTask
from replrl.tasks.explore import EXPLORE_HEADER, ExploreTask
from replrl.tasks.gsm8k import GSM8K_HEADER, GSM8KTask
from replrl.tasks.programs import PROGRAMS_HEADER, ProgramsTask

__all__ = [
    "ARITHMETIC_HEADER",
    "BUILTIN_TASKS",
    "DATASET_INSTRUCTIONS",
    "EXPLORE_HEADER",
    "GSM8K_HEADER",
    "PROGRAMS_HEADER",
    "ArithmeticTask",
    "DatasetTask",
    "ExploreTask",
    "GSM8KTask",
    "ProgramsTask",
    "Task",
    "TaskError",
    "TaskWithSetup",
    "load_task",
    "task_from_config",
]
