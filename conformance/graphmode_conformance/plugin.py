"""The pytest plugin of the conformance suite.

PYTEST_DONT_REWRITE: it holds no assert, and the forked runs import it before pytest starts
(``graphmode_conformance.processes``), where pytest would warn that it cannot rewrite it.

Options:
    --graphmode-vendor NAME    the vendor under test (default: $GRAPHMODE_VENDOR,
                               then detection)
    --graphmode-device DEV     where graphs run (default: the vendor's own device
                               when present, else the CPU emulator)
    --graphmode-plugin M:OBJ   test this plugin object instead of an installed
                               entry point (a plugin in development, a variant)
    --graphmode-variant ID     only this one of the vendor's option variants, named
                               as the test ids name it (update_path=task_group)
    --graphmode-xfails FILE    test ids expected to fail, one per line, # comments
    --graphmode-report FILE    a JSON report, one record per test
    --graphmode-block-size N, --graphmode-max-batches N, --graphmode-table-width N,
    --graphmode-capture-sizes 1,3,6, --graphmode-dtype float32|bfloat16|float16
                               sizes over the vendor's declarations and the
                               suite's defaults (graphmode_conformance.sizes)

Every test that builds a runner runs under each of the vendor's declared
``GraphSpec.option_variants`` (e.g. both Ascend update paths).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import graphmode
from graphmode.plugins import load_vendor, select_vendor
from graphmode_conformance.fixtures import ConformanceFixtures
from graphmode_conformance.sizes import DTYPES, Sizes, sizes_from_options, vendor_capture_sizes

ENV_PREFIXES = ("GRAPHMODE_", "ASCEND_", "CUDA_VISIBLE", "MLU_VISIBLE", "TORCH_NPU", "NCCL_")


@dataclass
class Target:
    vendor: graphmode.Vendor
    device: torch.device


def pytest_addoption(parser):
    group = parser.getgroup("graphmode", "graphmode conformance")
    group.addoption("--graphmode-vendor", default=None, help="vendor under test")
    group.addoption("--graphmode-device", default=None, help="device graphs run on (cpu: the emulator)")
    group.addoption("--graphmode-plugin", default=None, help="module:object: a plugin to test that is not installed")
    group.addoption("--graphmode-variant", default=None,
                    help="only this option variant, as the test ids name it (update_path=task_group)")
    group.addoption("--graphmode-xfails", default=None, help="file of test ids expected to fail")
    group.addoption("--graphmode-report", default=None, help="write a JSON report here")
    group.addoption("--graphmode-block-size", default=None, help="KV-cache block size (default: the vendor's first declared)")
    group.addoption("--graphmode-max-batches", default=None, help="the runner's max_batches (default 48)")
    group.addoption("--graphmode-table-width", default=None, help="block-table buffer width, in blocks (default 8)")
    group.addoption("--graphmode-capture-sizes", default=None,
                    help="a user capture list, e.g. 1,3,6 (default: the vendor's policy)")
    group.addoption("--graphmode-dtype", default=None, choices=sorted(DTYPES), help="model dtype (default float32)")


def plugin_object(plugin: str) -> Any:
    """The object ``--plugin MODULE:OBJECT`` names; a module that does not
    import or an object it lacks is one VendorError saying where the module
    was looked for (the current directory, as ``python -m`` looks)."""
    module_name, colon, attribute = plugin.partition(":")
    if not colon or not module_name or not attribute:
        raise graphmode.VendorError(
            f"--plugin {plugin}: give MODULE:OBJECT, a module and the object in it holding the hooks, joined by "
            f"a colon (--plugin {module_name or 'my_plugin'}:{attribute or 'plugin'}; `plugin = sys.modules[__name__]` "
            "in the module makes the module itself the object)"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not module_name.startswith(error.name):
            raise  # the plugin's own import of something else: its traceback says what
        raise graphmode.VendorError(
            f"--plugin {plugin}: no module {error.name!r} on the import path; a plugin module is looked for "
            f"in the current directory ({os.getcwd()}), as `python -m` looks, and in the installed packages. "
            f"Run from the directory holding {module_name.split('.')[0]!r}, or install the plugin"
        ) from error
    if not attribute or not hasattr(module, attribute):
        raise graphmode.VendorError(
            f"--plugin {plugin}: module {module_name} has no object {attribute!r}; give MODULE:OBJECT, the "
            f"object a module or an instance holding the hooks (`plugin = sys.modules[__name__]` for the module)"
        )
    return getattr(module, attribute)


def resolve_target(vendor: str | None, device: str | None, plugin: str | None = None) -> Target:
    """The vendor under test and its device, as the options ask."""
    if plugin:
        obj = plugin_object(plugin)
        named = obj.graphmode_vendor_info().name
        if vendor is not None and vendor != named:
            # Else every result would be reported under a name the plugin does not have.
            raise graphmode.VendorError(
                f"--vendor {vendor} --plugin {plugin}: the plugin's graphmode_vendor_info names {named!r}; "
                f"leave --vendor out (a plugin names itself) or pass --vendor {named}"
            )
        name = named
        chosen = load_vendor(name, plugin=obj)
        chosen.version = f"{plugin} ({chosen.version})"
        device = device or "cpu"
    else:
        chosen = select_vendor(vendor, device)
    if device is None:
        # Only a detected vendor's device types are asked about: torch may not
        # know the others at all (no "mlu" without torch_mlu).
        native = [t for t in chosen.info.device_types if chosen.info.runs_on(torch.device(t))[0]] \
            if chosen.info.detected else []
        device = native[0] if native else "cpu"
    return Target(chosen, torch.device(device))


@pytest.fixture(scope="session")
def graphmode_target(request) -> Target:
    """The vendor and device under test, from the command-line options."""
    return request.config._graphmode.get_target()


def variant_id(variant: Any) -> str:
    return ",".join(f"{k}={v}" for k, v in variant.items()) or "defaults"


def pytest_generate_tests(metafunc):
    """Every test that builds a runner, under each of the vendor's declared
    option variants, when the vendor comes from the options (a class that
    overrides ``vendor`` parametrizes ``vendor_options`` itself)."""
    cls = metafunc.cls
    if "vendor_options" not in metafunc.fixturenames or cls is None or not issubclass(cls, ConformanceFixtures):
        return
    if next(c for c in cls.__mro__ if "vendor" in vars(c)) is not ConformanceFixtures:
        return  # the class names its own vendor
    try:
        variants = metafunc.config._graphmode.get_target().vendor.spec.option_variants
    except Exception:  # the fixtures report a bad target, once per test, with its error
        return
    if variants:
        wanted = metafunc.config.getoption("--graphmode-variant")
        if wanted:
            variants = [pick_variant(variants, wanted)]
        metafunc.parametrize("vendor_options", [dict(v) for v in variants], ids=[variant_id(v) for v in variants])


def pick_variant(variants: Any, wanted: str) -> Any:
    """The option variant whose test id is ``wanted``; a ``pytest.UsageError``
    listing the declared ones when none is."""
    for variant in variants:
        if variant_id(variant) == wanted:
            return variant
    if not variants:
        raise pytest.UsageError(f"option variant {wanted!r}: the vendor declares no option variants "
                                "(GraphSpec.option_variants); leave the variant out")
    declared = ", ".join(variant_id(v) for v in variants)
    raise pytest.UsageError(f"option variant {wanted!r} is not one the vendor declares "
                            f"(GraphSpec.option_variants: {declared}); pass one of those")


def pytest_configure(config):
    config._graphmode = _State(config)
    config.pluginmanager.register(config._graphmode, "graphmode-conformance-state")


class _State:
    def __init__(self, config) -> None:
        self.config = config
        self.target: Target | None = None
        self.records: list[dict[str, Any]] = []
        self.xfail_ids: dict[str, str] = {}
        self.matched: set[str] = set()
        path = config.getoption("--graphmode-xfails")
        if path:
            self.xfail_ids = _read_xfails(Path(path))

    def get_target(self) -> Target:
        if self.target is None:
            option = self.config.getoption
            self.target = resolve_target(
                option("--graphmode-vendor"), option("--graphmode-device"), option("--graphmode-plugin")
            )
        return self.target

    def pytest_report_header(self, config):
        try:
            target = self.get_target()
        except graphmode.GraphModeError as error:
            return [f"graphmode: no vendor under test: {error}"]
        variant = config.getoption("--graphmode-variant")
        return [f"graphmode: {line}" for line in describe(target, sizes_from_options(config), variant)]

    def pytest_collection_modifyitems(self, config, items):
        for item in items:
            for test_id, reason in self.xfail_ids.items():
                if item.nodeid == test_id or item.nodeid.endswith("::" + test_id) or item.name == test_id:
                    item.add_marker(pytest.mark.xfail(reason=reason or "listed in the xfails file", strict=False))
                    self.matched.add(test_id)

    def pytest_collection_finish(self, session):
        for test_id in sorted(set(self.xfail_ids) - self.matched):
            warnings.warn(f"xfails file: {test_id!r} matches no test", pytest.PytestWarning, stacklevel=1)

    def pytest_terminal_summary(self, terminalreporter):
        unmatched = sorted(set(self.xfail_ids) - self.matched)
        if unmatched:
            terminalreporter.write_line(f"graphmode: xfail ids matching no test: {', '.join(unmatched)}")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            message = ""
            if report.failed:
                message = str(call.excinfo.value) if call.excinfo else str(report.longrepr)
            elif report.skipped:
                message = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
            outcome_name = "xfailed" if hasattr(report, "wasxfail") and report.skipped else (
                "xpassed" if hasattr(report, "wasxfail") else report.outcome)
            self.records.append({
                "id": item.nodeid, "test": item.name, "outcome": outcome_name,
                "duration_s": round(report.duration, 4), "message": message[:4000],
            })

    def pytest_sessionfinish(self, session, exitstatus):
        path = self.config.getoption("--graphmode-report")
        if not path:
            return
        target = self.target
        data = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "header": describe(target, sizes_from_options(self.config), self.config.getoption("--graphmode-variant"))
            if target else [],
            "vendor": target.vendor.name if target else None,
            "device": str(target.device) if target else None,
            "exit_status": int(exitstatus),
            "records": self.records,
        }
        Path(path).write_text(json.dumps(data, indent=1))


def describe(target: Target, sizes: Sizes | None = None, variant: str | None = None) -> list[str]:
    """What is under test: vendor, device, versions, the sizes and capture
    list used, the option variants that run (only ``variant`` when one is
    chosen, ``--variant``), the environment."""
    info = target.vendor.info
    device = target.device
    if device.type == "cpu":
        device_name = "CPU graph emulator"
    else:
        module = getattr(torch, device.type, None)
        get_name = getattr(module, "get_device_name", None)
        device_name = get_name(device) if get_name else device.type
    try:
        version = importlib.metadata.version("graphmode")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    sizes = sizes or Sizes()
    vendor = target.vendor
    try:
        capture = capture_list(vendor, sizes)
    except Exception as error:  # the header reports; the tests diagnose
        capture = f"not available ({type(error).__name__}: {error})".splitlines()[0]
        size_line = f"sizes: not available ({type(error).__name__})"
    else:
        size_line = f"sizes: {sizes.describe(vendor)}"
    try:
        variants = vendor.spec.option_variants
    except Exception:
        variants = ()
    return [
        f"vendor {vendor.name} (plugin {vendor.version}), runtime {info.runtime} "
        f"{info.runtime_version or 'not installed'}, capabilities {sorted(info.capabilities) or 'none'}",
        f"device {device} ({device_name}); torch {torch.__version__}; graphmode {version}",
        size_line,
        f"capture list at max_batches={sizes.max_batches}: {capture}",
        f"option variants (GraphSpec.option_variants): only {variant} (--variant)" if variant else
        "option variants (GraphSpec.option_variants), each test under every one: "
        + (", ".join(variant_id(v) for v in variants) if variants else "none (the vendor's defaults)"),
        f"environment: {env or 'no graphmode-related variables set'}",
    ]


def capture_list(vendor: graphmode.Vendor, sizes: Sizes) -> str:
    """The capture list a harness at ``sizes`` gets, and where it came from."""
    produced = list(vendor_capture_sizes(vendor, sizes))
    eager = f"; batches {produced[-1] + 1}..{sizes.max_batches} run eagerly" if produced[-1] < sizes.max_batches else ""
    if sizes.capture_sizes is None:
        return f"{produced} (the vendor's policy){eager}"
    trimmed = "" if produced == list(sizes.capture_sizes) else f", trimmed by the vendor from {list(sizes.capture_sizes)}"
    return f"{produced} (given{trimmed}){eager}"


def _read_xfails(path: Path) -> dict[str, str]:
    """Test ids from a file: one per line; '#' starts a comment, which
    becomes the reason. A file that is not there is a usage error (one line)."""
    if not path.is_file():
        raise pytest.UsageError(f"--graphmode-xfails {path}: no such file (a file of test ids expected to fail)")
    ids = {}
    for line in path.read_text().splitlines():
        text, _, comment = line.partition("#")
        if text.strip():
            ids[text.strip()] = comment.strip()
    return ids
