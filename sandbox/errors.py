"""The sandbox's errors, in a module that imports nothing: a command line can catch them without loading the kernel
machinery (jupyter_client, zmq) first."""


class KernelStartError(RuntimeError):
    """The kernel process could not be started (the message includes the tail of its log)."""


class SandboxUnavailable(RuntimeError):
    """The isolation asked for cannot be provided on this machine."""
