"""Plugin discovery through entry points (faked distributions), vendor
selection and its errors, hook validation, the allow-list and tracing."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import graphmode
from graphmode.plugins import describe_vendors, installed_vendor_names, load_vendor, select_vendor


class FakeDistribution(importlib.metadata.Distribution):
    """An installed package registering entry points, through
    importlib.metadata's own extension point: a Distribution reads its
    metadata files, here from memory instead of a dist-info directory."""

    def __init__(self, name: str, entry_points: dict[str, str]) -> None:
        self.files_text = {
            "METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n",
            "entry_points.txt": "[graphmode]\n" + "".join(f"{n} = {v}\n" for n, v in entry_points.items()),
        }

    def read_text(self, filename: str) -> str | None:
        return self.files_text.get(filename)

    def locate_file(self, path):  # no files on disk
        raise FileNotFoundError(path)


@pytest.fixture
def installed(monkeypatch):
    """Replace the installed distributions by fakes: ``installed(name=module)``."""

    def install(**plugins: str) -> None:
        dists = [FakeDistribution(f"graphmode-{n}", {n: f"plugins.{m}"}) for n, m in plugins.items()]
        monkeypatch.setattr(importlib.metadata, "distributions", lambda: dists)

    monkeypatch.delenv("GRAPHMODE_VENDOR", raising=False)
    monkeypatch.delenv("GRAPHMODE_PLUGINS", raising=False)
    return install


def test_entry_points_are_discovered(installed):
    installed(detected_a="detected_a", absent="absent")
    assert installed_vendor_names() == ["cuda", "absent", "detected_a"]
    vendor = load_vendor("detected_a")
    assert vendor.info.detected and vendor.version == "0.0.1"
    assert vendor.implements("graphmode_vendor_info")
    assert not vendor.implements("graphmode_fill_buffers")  # inherited from the defaults


def test_vendor_overrides_default_and_inherits_the_rest(installed):
    installed(absent="absent")
    vendor = load_vendor("absent")
    assert vendor.hook.graphmode_compatible_size(batch_size=1, capture_sizes=(1, 2, 4)) == 4
    sizes = vendor.hook.graphmode_capture_sizes(config=graphmode.RunnerConfig(8, 4, 16, "cpu"), spec=vendor.spec)
    assert sizes == [1, 2, 3, 4, 5, 6, 7, 8]  # the default's answer


def test_detection_picks_the_one_detected_vendor(installed):
    installed(detected_a="detected_a", absent="absent")
    assert select_vendor(device="cpu").name == "detected_a"


def test_detection_falls_back_to_the_default(installed):
    installed(absent="absent")
    assert select_vendor(device="cpu").name == "cuda"


def test_ambiguous_detection_lists_the_candidates(installed):
    installed(detected_a="detected_a", detected_b="detected_b")
    with pytest.raises(graphmode.VendorError, match="more than one vendor detected.*detected_a, detected_b"):
        select_vendor(device="cpu")


def test_environment_variable_chooses_the_vendor(installed, monkeypatch):
    installed(detected_a="detected_a", detected_b="detected_b")
    monkeypatch.setenv("GRAPHMODE_VENDOR", "detected_b")
    assert select_vendor(device="cpu").name == "detected_b"
    assert select_vendor("detected_a", device="cpu").name == "detected_a"  # the argument wins


def test_unknown_vendor_lists_what_is_installed(installed):
    installed(absent="absent")
    with pytest.raises(graphmode.VendorError) as error:
        select_vendor("ascnd", device="cpu")
    message = str(error.value)
    assert "no vendor plugin named 'ascnd'" in message
    assert "absent: not detected: torch_npu is not installed" in message
    assert "cuda:" in message


def test_vendor_unusable_on_the_device_says_why(installed):
    installed(absent="absent")
    with pytest.raises(graphmode.VendorError, match="'absent' cannot run graphs on cuda: it runs on npu"):
        select_vendor("absent", device="cuda")
    with pytest.raises(graphmode.VendorError, match="(?s)torch does not know the device 'npu'.*absent: not detected"):
        select_vendor("absent", device="npu")
    if not torch.cuda.is_available():
        with pytest.raises(graphmode.VendorError, match="no cuda device is available"):
            select_vendor("cuda", device="cuda")


def test_every_vendor_runs_on_the_cpu_emulator(installed):
    installed(absent="absent")
    assert select_vendor("absent", device="cpu").name == "absent"


def test_misspelt_hook_fails_at_load_naming_plugin_hook_and_signature(installed):
    installed(misspelt="misspelt")
    with pytest.raises(graphmode.VendorError) as error:
        load_vendor("misspelt")
    message = str(error.value)
    assert "vendor plugin 'misspelt'" in message
    assert "graphmode_fil_buffers(meta, inputs, batch_size, bucket): no such hook" in message
    assert "did you mean graphmode_fill_buffers?" in message


def test_hook_asking_for_an_unknown_argument_fails_at_load(installed):
    installed(wrong_argument="wrong_argument")
    with pytest.raises(graphmode.VendorError) as error:
        load_vendor("wrong_argument")
    assert "takes ['batch'], which the hook graphmode_fill_buffers(meta, inputs, batch_size, bucket)" in str(error.value)


def test_plugin_that_fails_to_import_is_reported_not_fatal(installed):
    installed(fails_to_import="fails_to_import", absent="absent")
    with pytest.raises(graphmode.VendorError, match="failed to import: ImportError"):
        load_vendor("fails_to_import")
    listing = describe_vendors()
    assert "fails_to_import: cannot load" in listing and "absent:" in listing
    assert select_vendor(device="cpu").name == "cuda"


def test_allow_list_hides_other_plugins(installed, monkeypatch):
    installed(detected_a="detected_a", absent="absent")
    monkeypatch.setenv("GRAPHMODE_PLUGINS", "absent")
    assert installed_vendor_names() == ["cuda", "absent"]
    with pytest.raises(graphmode.VendorError, match="no vendor plugin named 'detected_a'"):
        load_vendor("detected_a")


def test_an_allowed_list_that_hides_an_installed_plugin_says_so(installed, monkeypatch):
    installed(detected_a="detected_a", absent="absent")
    monkeypatch.setenv("GRAPHMODE_PLUGINS", "absent")
    with pytest.raises(graphmode.VendorError) as refused:
        load_vendor("detected_a")
    assert str(refused.value).startswith(
        "no vendor plugin named 'detected_a' is admitted: it is installed, but $GRAPHMODE_PLUGINS='absent' does not "
        "list it. Add it there, or unset $GRAPHMODE_PLUGINS."
    ), refused.value


def test_a_plugin_in_another_entry_point_group_is_named_with_the_fix(installed, monkeypatch):
    """A vendor's package declaring its entry point under "graphmode.plugins"
    was told only that no such vendor is installed, and to `pip install
    graphmode[xyz]`, an extra graphmode does not have."""
    misfiled = FakeDistribution("graphmode-xyz", {})
    misfiled.files_text["entry_points.txt"] = "[graphmode.plugins]\nxyz = graphmode_xyz.plugin\n"
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [misfiled])
    with pytest.raises(graphmode.VendorError) as refused:
        load_vendor("xyz")
    message = str(refused.value)
    assert "no vendor plugin named 'xyz' is installed" in message
    assert ("The package graphmode-xyz declares xyz = graphmode_xyz.plugin in the entry-point group "
            "'graphmode.plugins', but graphmode reads only the group 'graphmode': declare it under "
            "[project.entry-points.graphmode] and reinstall the package.") in message, message
    assert "graphmode[xyz]" not in message, message
    assert message.endswith("Install the vendor's package (the package that ships it; a plugin package declares "
                            "`NAME = module` under [project.entry-points.graphmode] in its pyproject.toml) or pick "
                            "one above."), message
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [])
    assert str(pytest.raises(graphmode.VendorError, load_vendor, "camb").value).endswith(
        "Install the vendor's package (pip install graphmode[camb]) or pick one above.")


def test_tracing_writes_hook_calls(installed, monkeypatch, capsys):
    installed(absent="absent")
    monkeypatch.setenv("GRAPHMODE_TRACE", "1")
    load_vendor("absent").hook.graphmode_compatible_size(batch_size=3, capture_sizes=(4, 8))
    err = capsys.readouterr().err
    assert "graphmode_compatible_size" in err and "finish graphmode_compatible_size --> 8" in err


def test_a_plugin_object_can_be_loaded_without_an_entry_point():
    from plugins import absent

    vendor = load_vendor("absent", plugin=absent)
    assert vendor.info.name == "absent"


def test_a_plugin_class_instead_of_an_instance_is_refused_at_load_naming_the_fix():
    class ZetaPlugin:
        @graphmode.hookimpl
        def graphmode_attention_ops(self):
            return None

    with pytest.raises(graphmode.VendorError, match=r"is the class .*ZetaPlugin, not a plugin object: .* "
                                          r"Register an instance \(.*ZetaPlugin\(\)\)"):
        load_vendor("zeta", plugin=ZetaPlugin)
    assert load_vendor("zeta", plugin=ZetaPlugin()).name == "zeta"


def test_installed_package_registers_its_vendors_through_entry_points():
    names = installed_vendor_names()
    assert {"ascend", "camb", "maca", "ppu"} <= set(names)


def test_vendors_command_lists_a_plugin_that_raises_with_its_error(installed, capsys):
    from graphmode.cli.vendors import add_arguments, run

    installed(refuses_config="refuses_config", absent="absent")
    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([])) == 0
    out = capsys.readouterr().out
    assert "error: ConfigError: block_size=16: this vendor takes blocks of 128 tokens" in out
    assert "Traceback" not in out
    assert out.count("capture list for max_batches=256") == 2  # cuda and absent: listing went on
    assert out.rstrip().splitlines()[-1] == (
        "chosen here: cuda (no other vendor's hardware is detected, so the built-in default answers)"
    )


def test_direct_skips_pluggy_only_where_the_answer_is_the_same(monkeypatch):
    import types

    from graphmode import hookimpl

    monkeypatch.delenv("GRAPHMODE_TRACE", raising=False)
    builtin = load_vendor("cuda")
    # One implementation (graphmode.default), taking every argument: its function.
    assert builtin.direct("graphmode_get_outputs") is graphmode.default.graphmode_get_outputs
    output = torch.arange(12.0).reshape(1, 4, 3)
    meta = types.SimpleNamespace(output_buffers={"output": output})
    direct = builtin.direct("graphmode_get_outputs")(meta=meta, batch_size=2, num_tokens=2)
    assert torch.equal(direct, builtin.hook.graphmode_get_outputs(meta=meta, batch_size=2, num_tokens=2))

    @hookimpl
    def graphmode_get_outputs(meta, num_tokens):
        return meta.output_buffers["output"][:, :num_tokens]

    plugin = types.SimpleNamespace(__name__="own", graphmode_get_outputs=graphmode_get_outputs,
                                   **{name: getattr(graphmode.default, name) for name in ("graphmode_vendor_info",)})
    own = load_vendor("cuda", plugin=plugin)
    # The vendor's own and the default: pluggy decides which answers.
    assert own.direct("graphmode_get_outputs") is own.hook.graphmode_get_outputs
    monkeypatch.setenv("GRAPHMODE_TRACE", "1")
    assert builtin.direct("graphmode_get_outputs") is builtin.hook.graphmode_get_outputs  # tracing sees every call


def test_the_vendors_listing_says_where_a_buffer_is_filled_from():
    """A buffer with a computed or path source says so; the default (its own
    context field) says nothing."""
    from graphmode.cli.vendors import _buffer
    from graphmode.spec import TOKENS, BufferSpec

    computed = BufferSpec("slot_blocks", torch.int32, shape=(TOKENS,), padding=-1,
                          source=lambda step: step.attn_metadata.kv_start_indices // 32)
    assert _buffer(computed) == "slot_blocks int32 (tokens) computed from the step, pad -1"
    paths = BufferSpec("kv_seqlens", torch.int32, padding=1, source=("attn_metadata.kv_seqlens_cpu", "attn_metadata.kv_seqlens"))
    assert _buffer(paths) == "kv_seqlens int32 (sequences) from attn_metadata.kv_seqlens_cpu or attn_metadata.kv_seqlens, pad 1"
    assert _buffer(BufferSpec("kv_seqlens", torch.int32, padding=1)) == "kv_seqlens int32 (sequences) pad 1"
