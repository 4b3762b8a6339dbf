"""Finding and loading vendor plugins.

Vendor plugins are found only through the ``graphmode`` entry-point group,
named after their vendor. Each loaded vendor gets its own plugin manager
holding the built-in CUDA defaults and that one vendor, registered after the
defaults so that its answers come first.

Environment:
    GRAPHMODE_PLUGINS: comma-separated entry-point names allowed to load
        (all, when unset).
    GRAPHMODE_TRACE: "1" writes every hook call and its result to stderr.
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import inspect
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

from graphmode import hookspecs
from graphmode.errors import VendorError
from graphmode.vendor_info import VendorInfo

if TYPE_CHECKING:
    from graphmode.spec import GraphSpec

__all__ = [
    "BUILTIN_VENDOR",
    "DEFAULT_PLUGIN_NAME",
    "ENTRY_POINT_GROUP",
    "ENV_PLUGINS",
    "ENV_TRACE",
    "Vendor",
    "describe_vendors",
    "installed_vendor_names",
    "load_vendor",
    "make_plugin_manager",
    "vendor_statuses",
]

ENTRY_POINT_GROUP = "graphmode"
BUILTIN_VENDOR = "cuda"
# The name graphmode.default (the built-in hook implementations) is registered under.
DEFAULT_PLUGIN_NAME = "graphmode.default"
ENV_PLUGINS = "GRAPHMODE_PLUGINS"
ENV_TRACE = "GRAPHMODE_TRACE"


def make_plugin_manager() -> pluggy.PluginManager:
    """A plugin manager with graphmode's hook specs and the built-in defaults."""
    from graphmode import default

    manager = pluggy.PluginManager("graphmode")
    manager.add_hookspecs(hookspecs)
    manager.register(default, name=DEFAULT_PLUGIN_NAME)
    if _tracing():
        manager.trace.root.setwriter(sys.stderr.write)
        manager.enable_tracing()
    return manager


def _tracing() -> bool:
    return os.environ.get(ENV_TRACE, "").strip() not in ("", "0")


def _allowed() -> set[str] | None:
    value = os.environ.get(ENV_PLUGINS)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """The ``graphmode`` group's entry points by name, from importlib.metadata's
    own selection (one distribution per name, the first on the path); of two
    distributions registering one name, the first wins."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry_point.name, entry_point)
    return found


def installed_vendor_names() -> list[str]:
    """The built-in vendor, then every installed entry point the allow-list
    admits, in name order."""
    allowed = _allowed()
    names = sorted(n for n in _entry_points() if allowed is None or n in allowed)
    return [BUILTIN_VENDOR, *(n for n in names if n != BUILTIN_VENDOR)]


class Vendor:
    """One vendor's plugins, ready to call: ``vendor.hook.graphmode_...``."""

    def __init__(self, name: str, manager: pluggy.PluginManager, plugin: Any, version: str) -> None:
        self.name = name
        self.manager = manager
        self.plugin = plugin
        self.version = version
        self.hook = manager.hook

    @functools.cached_property
    def info(self) -> VendorInfo:
        return self.hook.graphmode_vendor_info()

    @functools.cached_property
    def spec(self) -> GraphSpec:
        """The vendor's declarations (``graphmode_graph_spec``)."""
        from graphmode.spec import GraphSpec

        spec = self.hook.graphmode_graph_spec()
        if not isinstance(spec, GraphSpec):
            raise VendorError(
                f"vendor {self.name!r}: graphmode_graph_spec returned {type(spec).__name__}, not a "
                "graphmode.spec.GraphSpec; fix the plugin"
            )
        return spec

    def attention_ops(self, vendor_options: Any = None) -> Any:
        """The vendor's attention ops, built for ``vendor_options`` (a dict of
        its options' fields, its options object, or None for the defaults)."""
        options = self.spec.make_options(vendor_options, self.name)
        return self.hook.graphmode_attention_ops(options=options)

    def direct(self, hook_name: str) -> Callable[..., Any]:
        """``vendor.hook.<hook_name>``, or its one implementation's function
        where calling that gives the same answer: a firstresult hook with
        exactly one implementation, no wrapper, taking every argument of the
        spec, and tracing off. For the hooks of the replay path, where
        pluggy's dispatch (2.5 µs a call on a 2-core CI machine) is part of
        a step's host time. Taken once: a plugin registered later is not seen."""
        caller = getattr(self.hook, hook_name)
        impls = caller.get_hookimpls()
        spec = caller.spec
        if spec is None or not spec.opts.get("firstresult") or len(impls) != 1 or _tracing():
            return caller
        impl = impls[0]
        if impl.hookwrapper or impl.wrapper or set(impl.argnames) != set(spec.argnames):
            return caller
        return impl.function

    def implements(self, hook_name: str) -> bool:
        """Whether the vendor plugin itself (not the defaults) implements it."""
        return any(impl.plugin is self.plugin for impl in getattr(self.hook, hook_name).get_hookimpls())

    def built_in_only(self, hook_name: str) -> bool:
        """Whether every implementation of the hook is graphmode's built-in one."""
        return all(impl.plugin_name == DEFAULT_PLUGIN_NAME for impl in getattr(self.hook, hook_name).get_hookimpls())

    def __repr__(self) -> str:
        return f"<graphmode vendor {self.name} {self.version}>"


def load_vendor(name: str, plugin: Any = None) -> Vendor:
    """Load the vendor called ``name``.

    With ``plugin`` given, register that object instead of looking up the
    entry point: how tests and the conformance suite run a plugin that is not
    installed.
    """
    manager = make_plugin_manager()
    if plugin is not None:
        version = getattr(plugin, "__version__", "unversioned")
        _register(manager, plugin, name)
    elif name == BUILTIN_VENDOR:
        from graphmode import default as plugin

        version = _graphmode_version()
    else:
        allowed = _allowed()
        entry_point = _entry_points().get(name)
        if entry_point is None or (allowed is not None and name not in allowed):
            raise VendorError(_unknown_vendor_message(name, installed=entry_point is not None))
        dist = entry_point.dist
        version = dist.version if dist is not None else "unknown"
        try:
            plugin = entry_point.load()
        except Exception as error:
            package = f"{dist.name} {version}" if dist is not None else "an unknown package"
            raise VendorError(
                f"vendor plugin {name!r} ({entry_point.value}, from {package}) failed to import: {error!r}. "
                "Reinstall that package."
            ) from error
        _register(manager, plugin, name)
    return Vendor(name, manager, plugin, version)


def _register(manager: pluggy.PluginManager, plugin: Any, name: str) -> None:
    if isinstance(plugin, type):
        # pluggy registers a class too, and each hook call would then fail
        # with "missing 1 required positional argument: 'self'".
        raise VendorError(
            f"vendor plugin {name!r} is the class {plugin.__qualname__}, not a plugin object: hook "
            f"implementations are called on a module or an instance. Register an instance "
            f"({plugin.__qualname__}()), or make the hooks module-level functions"
        )
    try:
        manager.register(plugin, name=name)
        manager.check_pending()
    except pluggy.PluginValidationError as error:
        raise VendorError(_validation_message(name, plugin, error)) from error


def _validation_message(name: str, plugin: Any, error: pluggy.PluginValidationError) -> str:
    """Name the plugin, the hook, its signature, and the closest real hook."""
    known = [h for h in dir(hookspecs) if h.startswith("graphmode_")]
    lines = [f"vendor plugin {name!r} ({plugin!r}) does not match graphmode's hooks: {error}"]
    for attr in dir(plugin):
        function = getattr(plugin, attr, None)
        if not attr.startswith("graphmode_") or not callable(function):
            continue
        signature = _signature(attr, function)
        if attr not in known:
            close = difflib.get_close_matches(attr, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            lines.append(f"  {signature}: no such hook{hint}")
        else:
            spec = getattr(hookspecs, attr)
            extra = set(inspect.signature(function).parameters) - set(inspect.signature(spec).parameters)
            if extra:
                lines.append(
                    f"  {signature}: takes {sorted(extra)}, which the hook {_signature(attr, spec)} does not pass"
                )
    return "\n".join(lines)


def _signature(name: str, function: Any) -> str:
    try:
        return f"{name}({', '.join(inspect.signature(function).parameters)})"
    except (TypeError, ValueError):
        return name


# The listing lives here, not in selection.py: loading an unknown name lists
# the vendors, and listing them loads each.
def vendor_statuses() -> list[tuple[str, Vendor | None, str]]:
    """(name, loaded vendor or None, one-line status) per installed vendor."""
    rows: list[tuple[str, Vendor | None, str]] = []
    for name in installed_vendor_names():
        try:
            vendor = load_vendor(name)
            info = vendor.info
        except Exception as error:  # a broken plugin must not hide the others
            rows.append((name, None, f"cannot load: {error}".splitlines()[0]))
            continue
        state = "detected" if info.detected else "not detected"
        version = info.runtime_version or "unavailable"
        rows.append((
            name,
            vendor,
            f"{state}: {info.reason} [{info.runtime} {version}; graphs on "
            f"{', '.join(info.device_types)} and the cpu emulator]",
        ))
    return rows


def describe_vendors() -> str:
    """One line per installed vendor, for error messages and the CLI."""
    return "\n".join(f"  {name}: {status}" for name, _, status in vendor_statuses())


# The vendors graphmode ships, each an extra of its own package.
_SHIPPED = ("ascend", "camb", "maca", "ppu")


def _unknown_vendor_message(name: str, installed: bool = False) -> str:
    if installed:
        return (
            f"no vendor plugin named {name!r} is admitted: it is installed, but ${ENV_PLUGINS}="
            f"{os.environ.get(ENV_PLUGINS)!r} does not list it. Add it there, or unset ${ENV_PLUGINS}. "
            f"Admitted vendors:\n{describe_vendors()}"
        )
    install = (
        f"pip install graphmode[{name}]" if name in _SHIPPED
        else "the package that ships it; a plugin package declares `NAME = module` under "
        f"[project.entry-points.{ENTRY_POINT_GROUP}] in its pyproject.toml"
    )
    lines = [f"no vendor plugin named {name!r} is installed. Installed vendors:", describe_vendors()]
    lines += [
        f"The package {package} declares {ep.name} = {ep.value} in the entry-point group {ep.group!r}, but "
        f"graphmode reads only the group {ENTRY_POINT_GROUP!r}: declare it under "
        f"[project.entry-points.{ENTRY_POINT_GROUP}] and reinstall the package."
        for package, ep in _misfiled(name)
    ]
    lines.append(f"Install the vendor's package ({install}) or pick one above.")
    return "\n".join(lines)


def _misfiled(name: str) -> list[tuple[str, importlib.metadata.EntryPoint]]:
    """(package, entry point) of each entry point called ``name`` in another
    group named after graphmode (``graphmode.plugins``): a plugin package's slip."""
    return [
        (dist.metadata["Name"], ep)
        for dist in importlib.metadata.distributions()
        for ep in dist.entry_points
        if ep.name == name and ep.group != ENTRY_POINT_GROUP and "graphmode" in ep.group.lower()
    ]


def _graphmode_version() -> str:
    import graphmode

    return graphmode.__version__
