"""The family layer (quant/families): one layer below the rest (no import circle), strict data files (an unknown
key in a family, recipe or toy file is an error naming it, exit 2), unknown model types named with how to add
them, and the five families added as data (DeepSeek-V3.2, Kimi-K2.5, MiniMax-M2, MiniMax-M3, GLM-4.7): toys with
the release names, quantize + preflight clean under every engine, per-family `--recipe amd`."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from quant.checkpoint import open_checkpoint
from quant.errors import QuantError
from quant.families import (all_text_prefixes, family_for_config, load_family, lookup_family, text_prefix,
                            unknown_family_note)
from quant.families.schema import BadData

pytestmark = pytest.mark.xdist_group("toy")
ROOT = Path(__file__).resolve().parents[1]
NEW_TOYS = {"deepseek-v3.2": "deepseek_v32", "kimi-k2.5": "kimi_k25", "minimax-m2": "minimax_m2",
            "minimax-m3": "minimax_m3_vl", "glm4.7": "glm4_moe"}


# ------------------------------------------------------------------------------------------------ layering


def import_graph() -> dict[str, set[str]]:
    """module -> project modules it imports (module level and inside functions), for quant/ and evals/."""
    mods = {}
    for pkg in ("quant", "evals"):
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps |= {resolve(f"{node.module}.{a.name}") or resolve(node.module) for a in node.names}
        graph[mod] = {d for d in deps if d and d != mod}
    return graph


def test_no_import_circle():
    graph = import_graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(mod):
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                pytest.fail("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod)


def test_the_family_layer_imports_nothing_above_it():
    graph = import_graph()
    for mod, deps in graph.items():
        if mod.startswith("quant.families"):
            assert deps <= {"quant.errors", "quant.paths", "quant.families", "quant.families.schema",
                            "quant.families.adapters"}, (mod, deps)


# --------------------------------------------------------------------------------------- strict data files


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_unknown_key_in_a_family_file_is_named(tmp_path, monkeypatch):
    import quant.families as families

    shutil.copytree(families.families_dir(), tmp_path / "families")
    write(tmp_path / "families" / "mine.yaml", "family: mine\ninherit: generic\nmodel_types: [mine]\nrolez: {}\n")
    monkeypatch.setattr(families, "families_dir", lambda: tmp_path / "families")
    with pytest.raises(BadData, match=r"mine.yaml: unknown key 'rolez' \(did you mean 'roles'\?\)") as e:
        load_family("mine")
    assert e.value.exit_code == 2


def test_a_misspelled_mtp_key_in_a_family_file_is_named(tmp_path, monkeypatch):
    import quant.families as families

    shutil.copytree(families.families_dir(), tmp_path / "families")
    write(tmp_path / "families" / "mine.yaml",
          "family: mine\ninherit: generic\nmtp: {first_layer_key: num_hidden_layers, count_keys: n}\n")
    monkeypatch.setattr(families, "families_dir", lambda: tmp_path / "families")
    with pytest.raises(BadData, match="unknown key 'count_keys' in mtp"):
        load_family("mine")


@pytest.mark.parametrize("text,key", [
    ("bse: experts-only\nroles: {attention: fp8}\n", "bse"),
    ("base: experts-only\nmtp_layr: bf16\n", "mtp_layr"),
    ("base: experts-only\nroles: {atention: fp8}\n", "atention"),
    ("base: experts-only\nkeep: ['x']\nkep: ['y']\n", "kep"),
])
def test_unknown_key_in_a_user_recipe_is_named(tmp_path, text, key):
    from quant.planning.recipes import load_recipe

    with pytest.raises(QuantError, match=f"unknown key '{key}'") as e:
        load_recipe(str(write(tmp_path / "r.yaml", text)))
    assert e.value.exit_code == 2


def test_a_user_recipe_with_known_keys_still_loads(tmp_path):
    from quant.planning.recipes import load_recipe

    recipe = load_recipe(str(write(tmp_path / "r.yaml", "base: experts-only\nroles: {attention: fp8}\n"
                                                         "keep: ['layers\\.0\\.']\nmtp_layer: bf16\n")))
    assert recipe.roles["attention"] == "fp8" and recipe.mtp_layer == "bf16" and recipe.keep


def test_unknown_key_in_toys_yaml_is_named(tmp_path):
    from quant.toy import TOYS_MANIFEST, _manifest

    text = TOYS_MANIFEST.read_text().replace("    config_class: Qwen3MoeConfig\n",
                                             "    config_class: Qwen3MoeConfig\n    fused_expert: false\n")
    with pytest.raises(BadData, match="qwen3-moe: unknown key 'fused_expert'") as e:
        _manifest(write(tmp_path / "toys.yaml", text))
    assert e.value.exit_code == 2


def test_cli_prints_one_line_and_exits_2_for_a_misspelled_recipe(tmp_path, toy_factory):
    import subprocess
    import sys

    recipe = write(tmp_path / "r.yaml", "base: experts-only\nmtp_layr: bf16\n")
    run = subprocess.run([sys.executable, "-m", "quant.cli", "quantize", str(toy_factory("qwen3-moe")),
                          str(tmp_path / "out"), "--recipe", str(recipe)], capture_output=True, text=True)
    assert run.returncode == 2, run.stderr
    assert "mtp_layr" in run.stderr and len(run.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------- unknown families


def test_an_unknown_model_type_is_named_with_how_to_add_it():
    config = {"model_type": "fancy_moe", "hidden_size": 8, "num_hidden_layers": 1}
    note = unknown_family_note(config)
    assert "'fancy_moe'" in note and "fancy_moe.yaml" in note and "add it" in note
    assert family_for_config(config).name == "generic"
    assert unknown_family_note({"model_type": "glm4_moe"}) is None


def test_preflight_of_an_unknown_family_warns_once_and_still_checks_names(toy_factory, tmp_path):
    from quant.verify import verify_checkpoint

    src = tmp_path / "src"
    shutil.copytree(toy_factory("qwen3-moe"), src)
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "mixtral"  # transformers knows it; no family file does
    (src / "config.json").write_text(json.dumps(config))
    report = verify_checkpoint(src, engines=["vllm==0.32"])
    notes = [f for f in report.findings if f.rule == "model family"]
    assert len(notes) == 1 and "'mixtral'" in notes[0].message and notes[0].severity == "warning"


# --------------------------------------------------------------------------------------------- family data


def test_family_lookup_prefers_the_wrapper_model_type():
    assert lookup_family({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2"}}) == "kimi_k25"
    assert lookup_family({"model_type": "kimi_k2"}) == "deepseek_v3"
    assert lookup_family({"model_type": "minimax_m3_vl"}) == "minimax_m3_vl"


def test_text_prefix_is_family_data():
    assert "language_model.model." in all_text_prefixes()
    assert text_prefix(["language_model.model.layers.0.mlp.gate.weight", "vision_tower.x"]) == "language_model.model."
    assert text_prefix(["model.language_model.layers.0.x"]) == "model.language_model."
    assert text_prefix(["model.layers.0.x"]) == "model."


@pytest.fixture(scope="module")
def new_toys(tmp_path_factory) -> dict[str, Path]:
    from quant.toy import build_toy

    root = tmp_path_factory.mktemp("new-families")
    return {name: build_toy(name, root / name) for name in NEW_TOYS}


@pytest.mark.parametrize("toy,family", NEW_TOYS.items())
def test_new_toy_is_its_family(new_toys, toy, family):
    assert family_for_config(open_checkpoint(new_toys[toy]).config).name == family


def test_release_names_of_the_new_toys(new_toys):
    def names(toy):
        return open_checkpoint(new_toys[toy]).tensors

    v32 = names("deepseek-v3.2")
    for leaf in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
        assert f"model.layers.2.self_attn.indexer.{leaf}" in v32  # MTP layer 2 has its indexer too
    assert v32["model.layers.1.self_attn.indexer.weights_proj.weight"].dtype == "F32"
    assert v32["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "F32"
    assert "model.layers.2.shared_head.head.weight" in v32 and "model.layers.2.eh_proj.weight" in v32

    kimi = names("kimi-k2.5")
    assert "language_model.lm_head.weight" in kimi and "language_model.model.layers.1.mlp.experts.7.up_proj.weight" in kimi
    assert any(n.startswith("vision_tower.encoder.blocks.0.wqkv") for n in kimi)
    assert any(n.startswith("mm_projector.proj.0.") for n in kimi) and "mm_projector.pre_norm.weight" in kimi
    assert not any(n.startswith("model.") or ".blocks." in n and n.startswith("language_model") for n in kimi)
    kimi_config = open_checkpoint(new_toys["kimi-k2.5"]).config
    assert kimi_config["text_config"]["model_type"] == "kimi_k2"

    m2 = names("minimax-m2")
    for leaf in ("w1", "w2", "w3"):
        assert f"model.layers.1.block_sparse_moe.experts.0.{leaf}.weight" in m2
    assert m2["model.layers.1.block_sparse_moe.e_score_correction_bias"].dtype == "F32"
    assert not any("shared_expert" in n or ".mlp." in n for n in m2)

    m3 = names("minimax-m3")
    assert "language_model.model.layers.1.block_sparse_moe.shared_experts.up_proj.weight" in m3
    assert "language_model.model.layers.0.mlp.up_proj.weight" in m3  # dense first layer
    assert "language_model.model.layers.1.self_attn.index_q_proj.weight" in m3
    assert any(n.startswith("vision_tower.vision_model.") for n in m3)

    glm = names("glm4.7")
    assert all(f"model.layers.1.self_attn.{p}_proj.bias" in glm for p in "qkv")
    assert "model.layers.0.mlp.gate_proj.weight" in glm and "model.layers.2.eh_proj.weight" in glm


@pytest.mark.parametrize("toy", NEW_TOYS)
def test_new_family_quantizes_and_passes_every_engine(new_toys, toy, tmp_path):
    from quant.pipeline import quantize_checkpoint
    from quant.verify import verify_checkpoint

    out = tmp_path / "q"
    quantize_checkpoint(new_toys[toy], out, recipe="all-linear", check_engines=None, log=lambda m: None)
    tensors = open_checkpoint(out).tensors
    assert any(t.dtype == "U8" for t in tensors.values())
    # Vision towers and projectors stay BF16 whatever the recipe.
    assert all(t.dtype != "U8" for n, t in tensors.items()
               if n.startswith(("vision_tower.", "mm_projector.", "multi_modal_projector.", "patch_merge_mlp.")))
    report = verify_checkpoint(out, engines=["sglang", "vllm"])
    assert not report.errors, [f.message for f in report.errors]


def test_minimax_mtp_is_refused_in_one_line(new_toys):
    from evals.arms.mtp_draft import draft_layers

    ckpt = open_checkpoint(new_toys["minimax-m2"])
    assert ckpt.config["num_mtp_modules"] == 3 and ckpt.config["use_mtp"] is True
    with pytest.raises(QuantError, match="num_mtp_modules") as e:
        draft_layers(ckpt.config, ckpt.tensors)
    assert "\n" not in str(e.value)
    line = load_family("minimax_m2").unpublished_mtp(ckpt.config, ckpt.tensors)
    assert "publishes no MTP weights" in line and "--no-mtp" in line


# ------------------------------------------------------------------------------------------- --recipe amd


def plan_for(src: Path, recipe: str):
    from quant.planning.plan import make_plan
    from quant.planning.recipes import load_recipe
    from quant.planning.schemes import get_scheme

    ckpt = open_checkpoint(src)
    family = family_for_config(ckpt.config)
    return make_plan(ckpt, family, load_recipe(recipe, family), get_scheme("w_mxfp4_a_mxfp4"), "even")


def test_amd_recipe_kimi_quantizes_routed_experts_only(new_toys):
    plan = plan_for(new_toys["kimi-k2.5"], "amd")
    assert plan.quantized and all(".mlp.experts." in m for m in plan.quantized)
    assert any(".shared_experts." in m for m in plan.kept_modules)
    assert any(".self_attn." in m for m in plan.kept_modules) and "source" in plan.recipe


def test_amd_recipe_glm5_keeps_the_whole_mtp_layer(toy_factory):
    plan = plan_for(toy_factory("glm5"), "amd")
    n = open_checkpoint(toy_factory("glm5")).config["num_hidden_layers"]
    assert not any(m.startswith(f"model.layers.{n}.") for m in plan.quantized)
    assert any(m.startswith("model.layers.1.mlp.shared_experts.") for m in plan.quantized)


def test_amd_recipe_qwen35_keeps_attention_linear_attention_vision_and_mtp(toy_factory):
    plan = plan_for(toy_factory("qwen3.5"), "amd")
    assert all(".mlp." in m and not m.startswith("mtp.") for m in plan.quantized)
    assert any(".linear_attn." in m for m in plan.kept_modules) and any(".self_attn." in m for m in plan.kept_modules)


def test_amd_recipe_for_a_family_without_a_release_says_so(new_toys):
    with pytest.raises(QuantError, match="minimax_m2 family has no 'amd' release recipe"):
        plan_for(new_toys["minimax-m2"], "amd")
