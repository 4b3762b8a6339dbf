"""What to tell the user when torch itself fails to import.

torch auto-loads every installed device backend (entry-point group
``torch.backends``) at import, and re-raises a backend's failure as
``RuntimeError: Failed to load the backend extension: NAME``. torch_npu
installed without Huawei's CANN libraries is the common case
(``pip install graphmode[ascend]`` on a machine without CANN): then
``import torch`` fails everywhere, not only for Ascend. This module imports no
torch, so the ``graphmode`` command can explain that instead of dying in a
traceback.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

__all__ = ["explain_torch_failure", "torch_import_failure"]

BACKEND_GROUP = "torch.backends"
# What each known backend needs beyond its wheel.
_NEEDS = {
    "torch_npu": "Huawei's CANN toolkit, loaded with `source /usr/local/Ascend/ascend-toolkit/set_env.sh` "
    "(its default path for a root install)",
}


def torch_import_failure() -> str | None:
    """None when torch imports; otherwise advice on why it did not."""
    try:
        import torch  # noqa: F401
    except Exception as error:
        return explain_torch_failure(error)
    return None


def _root_cause(error: BaseException) -> BaseException:
    """The innermost exception of an explicit ``raise ... from`` chain, or of
    the implicit chain when none was given."""
    while True:
        inner = error.__cause__ or error.__context__
        if inner is None:
            return error
        error = inner


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0]


def _failed_backend(error: BaseException) -> EntryPoint | None:
    """The ``torch.backends`` entry point that torch's message names."""
    message = str(error)
    for backend in entry_points(group=BACKEND_GROUP):
        if f"backend extension: {backend.name}." in message:
            return backend
    return None


def explain_torch_failure(error: BaseException) -> str:
    """Advice for ``error``, raised by ``import torch``: which backend failed
    and what it is missing, and how to run without it."""
    cause = _describe(_root_cause(error))
    backend = _failed_backend(error)
    if backend is None:
        installed = sorted(backend.name for backend in entry_points(group=BACKEND_GROUP))
        lines = [f"graphmode: torch failed to import: {cause}"]
        if installed:
            lines.append(
                f"  torch auto-loads the device backends {', '.join(installed)}; if one of them fails, "
                "run with TORCH_DEVICE_BACKEND_AUTOLOAD=0 to leave them out."
            )
        else:
            lines.append("  Reinstall torch in this environment (see README.md, 'The two commands').")
        return "\n".join(lines)
    package = f"{backend.dist.name} {backend.dist.version}" if backend.dist is not None else "an installed package"
    lines = [
        f"graphmode: torch failed to import because it auto-loads the device backend {backend.name!r} "
        f"({package}, entry point {backend.value}), and that failed:",
        f"  {cause}",
        "  To run without that backend (the CPU emulator, other vendors): set TORCH_DEVICE_BACKEND_AUTOLOAD=0, "
        "e.g. `TORCH_DEVICE_BACKEND_AUTOLOAD=0 graphmode vendors`.",
    ]
    needs = _NEEDS.get(backend.name)
    lines.append(
        f"  To use it, install what it is missing{f': {needs}' if needs else ''}."
    )
    return "\n".join(lines)
