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
                            "quant.families.adapters", "quant.families.sidecars", "quant.families.mtp"}, (mod, deps)


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


def _toys_copy(tmp_path: Path, name: str, old: str, new: str) -> Path:
    """A copy of manifests/toys with `old` replaced by `new` in NAME.yaml."""
    from quant.toy.build import TOYS_DIR

    shutil.copytree(TOYS_DIR, tmp_path / "toys")
    path = tmp_path / "toys" / f"{name}.yaml"
    assert old in path.read_text()
    write(path, path.read_text().replace(old, new, 1))
    return tmp_path / "toys"


def test_unknown_key_in_a_toy_is_named(tmp_path):
    from quant.toy.build import TOYS_MANIFEST, _manifest

    toys = _toys_copy(tmp_path, "qwen3_moe", "    config_class: Qwen3MoeConfig\n",
                      "    config_class: Qwen3MoeConfig\n    fused_expert: false\n")
    with pytest.raises(BadData, match=r"qwen3_moe.yaml: toys.qwen3-moe: unknown key 'fused_expert'") as e:
        _manifest(TOYS_MANIFEST, toys)
    assert e.value.exit_code == 2


def test_unknown_key_in_toys_yaml_is_named(tmp_path):
    from quant.toy.build import TOYS_MANIFEST, _manifest

    text = TOYS_MANIFEST.read_text().replace("\nperturbations:\n", "\nperturbation:\n")
    with pytest.raises(BadData, match="toys.yaml: unknown key 'perturbation'") as e:
        _manifest(write(tmp_path / "toys.yaml", text))
    assert e.value.exit_code == 2


def test_every_toy_lives_beside_its_family_record_and_toys_yaml_keeps_only_the_shared_keys():
    import yaml

    from quant.families import families_dir, family_names
    from quant.toy import TOY_NAMES, TOYS_MANIFEST, toy_family
    from quant.toy.build import TOYS_DIR

    assert set(yaml.safe_load(TOYS_MANIFEST.read_text())) == {"order", "quantization_config", "perturbations"}
    files = {p.stem: yaml.safe_load(p.read_text())["toys"] for p in TOYS_DIR.glob("*.yaml")}
    assert set(files) <= set(family_names())
    defined = [toy for toys in files.values() for toy in toys]
    assert sorted(defined) == sorted(TOY_NAMES) and len(set(defined)) == len(defined)
    for toy in TOY_NAMES:
        assert toy in files[toy_family(toy).family]
    assert not any("toys" in yaml.safe_load(p.read_text()) for p in families_dir().glob("*.yaml"))
    assert {toy_family(t).family for t in ("qwen3-moe", "qwen3.5", "qwen3.5-fused")} == {"qwen3_moe"}
    assert toy_family("glm5-next").family == "glm5_next"  # its own file, though the family inherits glm_moe_dsa
    assert TOY_NAMES[:3] == ("glm5", "deepseek-v3", "qwen3-moe")  # toys.yaml `order`, not the files' order


def test_a_toy_toys_yaml_does_not_list_comes_after_the_listed_ones(tmp_path):
    from quant.toy.build import TOYS_MANIFEST, _manifest

    text = TOYS_MANIFEST.read_text().replace("glm4.7, ", "")
    names = list(_manifest(write(tmp_path / "toys.yaml", text))["toys"])
    assert names[-1] == "glm4.7" and names[:-1] == [n for n in _manifest()["toys"] if n != "glm4.7"]


@pytest.mark.parametrize("edit,message", [
    (("perturb_base: norm\n", "perturb_base: nrom\n"), "perturb_base 'nrom' is not a table"),
    (("toys:\n  glm5:\n", "toys:\n  glm5x:\n"), "'order' lists glm5, which no toy file defines"),
    (("toys:\n", "toy:\n"), "glm_moe_dsa.yaml: unknown key 'toy'"),
])
def test_a_toy_naming_what_toys_yaml_lacks_is_refused(tmp_path, edit, message):
    from quant.toy.build import TOYS_MANIFEST, _manifest

    with pytest.raises(BadData, match=message):
        _manifest(TOYS_MANIFEST, _toys_copy(tmp_path, "glm_moe_dsa", *edit))


def test_a_toy_defined_twice_or_of_no_family_is_refused(tmp_path):
    from quant.toy.build import TOYS_MANIFEST, _manifest

    toys = _toys_copy(tmp_path, "glm4_moe", "toys:\n  glm4.7:\n", "toys:\n  glm5:\n")
    with pytest.raises(BadData, match="toys.glm5: toy 'glm5' is already defined in"):
        _manifest(TOYS_MANIFEST, toys)
    (toys / "glm4_moe.yaml").rename(toys / "glm4_mo.yaml")
    with pytest.raises(BadData, match="glm4_mo.yaml: no model family 'glm4_mo'"):
        _manifest(TOYS_MANIFEST, toys)


def test_perturb_base_comes_first_and_the_toys_own_entries_after():
    from quant.toy import toy_family

    norm = ["norm\\.weight$", "norm\\.bias$", "\\.e_score_correction_bias$"]
    assert list(toy_family("glm5").perturb) == norm
    assert list(toy_family("glm4.7").perturb) == norm + ["\\.self_attn\\.[qkv]_proj\\.bias$"]
    assert list(toy_family("deepseek-v4").perturb) == ["norm\\.weight$", "\\.gate\\.bias$"]  # no base: its own


def test_each_family_names_its_architecture_classes():
    from quant.families import family_names

    assert load_family("glm_moe_dsa").architectures == {"glm_moe_dsa": ["GlmMoeDsaForCausalLM"]}
    assert load_family("deepseek_v3").architecture_classes() == ["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"]
    assert load_family("glm5_next").architectures == {"glm5_next": ["Glm5NextForConditionalGeneration"]}  # own only
    owner: dict[str, str] = {}
    for name in family_names():
        family = load_family(name)
        assert set(family.architectures) <= set(family.model_types), name
        if name != "generic":
            assert family.architectures, f"{name}.yaml names no architecture class"
        for cls in family.architecture_classes():
            assert owner.setdefault(cls, name) == name, f"{cls}: {owner[cls]} and {name}"


@pytest.mark.parametrize("text,message", [
    ("architectures: {other: [XForCausalLM]}\n", "names model_type 'other', which is not one of the file's"),
    ("architectures: {mine: []}\n", "architectures.mine must be a non-empty list of class names"),
    ("architectures: [XForCausalLM]\n", "architectures must be a mapping of model_type"),
    ("toys: {x: {}}\n", "unknown key 'toys'"),
    ("fused_experts: {gate_up_proj: {split: [gate_proj, up_proj], dim: 2}}\n",
     r"fused_experts.gate_up_proj.dim must be 1"),
    ("fused_experts: {gate_up_proj: {split: []}}\n", r"fused_experts.gate_up_proj.split must list the linears"),
    ("fused_experts: {gate_up_proj: {splits: [gate_proj]}}\n", r"unknown key 'splits'"),
    ("fused_experts: [gate_up_proj]\n", r"fused_experts must map a fused parameter"),
])
def test_a_malformed_key_of_a_family_file_is_named(tmp_path, monkeypatch, text, message):
    import quant.families as families

    shutil.copytree(families.families_dir(), tmp_path / "families")
    write(tmp_path / "families" / "mine.yaml", "family: mine\ninherit: generic\nmodel_types: [mine]\n" + text)
    monkeypatch.setattr(families, "families_dir", lambda: tmp_path / "families")
    with pytest.raises(BadData, match=message):
        load_family("mine")


# ---------------------------------------------------------------------------------------------- MTP layers


@pytest.mark.parametrize("config,count,indices,decoder_layers,count_key", [
    # DeepSeek-V3 / GLM: model.layers.{N + k}
    ({"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_nextn_predict_layers": 1}, 1, [61], [61],
     "num_nextn_predict_layers"),
    ({"model_type": "glm_moe_dsa", "num_hidden_layers": 78, "num_nextn_predict_layers": 2}, 2, [78, 79], [78, 79],
     "num_nextn_predict_layers"),
    ({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", "num_hidden_layers": 61,
                                                "num_nextn_predict_layers": 0}}, 0, [], [], "num_nextn_predict_layers"),
    # Qwen3.5 / Qwen4-Exp: mtp.layers.{k} under text_config.mtp_num_hidden_layers, not in the decoder stack
    ({"model_type": "qwen3_5_moe", "text_config": {"num_hidden_layers": 60, "mtp_num_hidden_layers": 1}}, 1, [60], [],
     "mtp_num_hidden_layers"),
    ({"model_type": "qwen4_exp", "text_config": {"num_hidden_layers": 40, "mtp_num_hidden_layers": 1}}, 1, [40], [],
     "mtp_num_hidden_layers"),
    ({"model_type": "qwen3_moe", "num_hidden_layers": 48}, 0, [], [], "mtp_num_hidden_layers"),
    # DeepSeek-V4: mtp.{k}.*, counted by num_nextn_predict_layers
    ({"model_type": "deepseek_v4", "num_hidden_layers": 43, "num_nextn_predict_layers": 1}, 1, [43], [],
     "num_nextn_predict_layers"),
    # MiniMax-M2 declares MTP modules it never published (its layout's `unpublished` says so)
    ({"model_type": "minimax_m2", "num_hidden_layers": 62, "num_mtp_modules": 3}, 3, [62, 63, 64], [],
     "num_mtp_modules"),
    ({"model_type": "some_new_model", "num_hidden_layers": 4}, 0, [], [], "num_nextn_predict_layers"),
])
def test_mtp_layers_from_config_and_family(config, count, indices, decoder_layers, count_key):
    from quant.families import mtp_layout

    family = load_family(lookup_family(config) or "generic")
    mtp = mtp_layout(config, family)
    assert (mtp.count, list(mtp.indices), list(mtp.decoder_layers), mtp.count_key) == \
        (count, indices, decoder_layers, count_key)
    assert mtp_layout(config) == mtp  # the config's own family is the same answer


def test_mtp_layers_defaults_to_the_configs_family():
    from quant.families import mtp_layout

    config = {"model_type": "glm4_moe", "hidden_size": 8, "num_hidden_layers": 92, "n_routed_experts": 4,
              "num_nextn_predict_layers": 1}
    assert mtp_layout(config) == mtp_layout(config, load_family("glm4_moe"))
    assert list(mtp_layout(config).decoder_layers) == [92]


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
    from quant.families import mtp_layout

    line = mtp_layout(ckpt.config).unpublished_line(ckpt.tensors)
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


def test_fused_experts_split_in_order():
    from quant.families import FusedSplit

    fused = load_family("qwen3_moe").fused_experts
    assert fused == {"gate_up_proj": FusedSplit(("gate_proj", "up_proj")), "down_proj": FusedSplit(("down_proj",))}
    assert load_family("qwen4_exp").fused_experts == fused  # inherited
    assert load_family("deepseek_v3").fused_experts is None
