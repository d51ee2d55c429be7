"""Benchmark: `quant search` against the peers' own mixed-precision searches, on CPU (BENCHMARKS.md, "quant search
against the peers' searches (CPU)").

The toy tests/data/gptq_toy/model, calibration 128 windows of 128 tokens of its calib.jsonl (tokenized by this
tool's `calibration_tokens`, saved to a .pt file the peers read), two budgets in this tool's effective bits
(stored bits per parameter of the linears a recipe could quantize, quant_manifest.json summary.effective_bits):
that of recipe experts-mxfp4-rest-mxfp8, and halfway from it to recipe all-linear. Searched by:
  - this tool's `quant search` (quant.search.run.search, --bits B), once with `--engine vllm` (whose releases load
    MXFP8, as the peers' menus do) and once with its default releases (vLLM and SGLang: SGLang 0.5.12 has no MXFP8);
  - NVIDIA ModelOpt 0.47.0 `mtq.auto_quantize`, method "gradient" (its default) and "kl_div", formats MXFP4,
    MXFP8 and per-channel FP8, weight-only as the exports store them, priced at this tool's stored bits (4.25,
    8.25, 8.25), in .venv-modelopt. Its MX fake quantization is a CUDA extension only (tensor_quant.py:184,
    get_cuda_ext_mx(raise_if_failed=True)): on CPU this script hands it a torch stand-in (`_TorchMx`);
  - auto-round 0.16.1 `AutoScheme` (options weight-only MXFP4 and MXFP8, and BF16) in .venv-autoround; its
    glm_moe_dsa rule keeps layer 0's MLP and the indexer BF16, so it refuses budgets below about 5.9 bits.
Each peer sees the main model's linears only (transformers never runs the MTP layer, model.layers.2) less those
this tool keeps BF16 in those recipes (lm_head, the routers mlp.gate, the indexer's wk and weights_proj); the MTP
layer is then given MXFP4, as `quant search` pins it, and the peer's budget is the one that makes the whole
export's effective bits B (MTP at 4.25 bits, the indexer's wk at 16). Each peer's per-linear pick is translated
into a user recipe (base all-linear, one anchored `modules:` entry per linear: scheme / mxfp8 / fp8 / bf16),
exported with quantize_checkpoint, scored with `evals.arms.nll.mean_nll` on `gptq_toy_heldout(windows=10**6)`, and
checked by verify-manifest for the serving releases (the releases that would refuse it).
llm-compressor 0.14.0.1 has no HIGGS / target-bitwidth search (checked by grep, see BENCHMARKS.md): no row.

    PYTHONPATH=. .venv/bin/python scripts/bench_search_peers.py
        [--peers ours_vllm,ours,modelopt,modelopt_kl,autoround] [--work /tmp/bench-search-peers] [--venvs /work/main]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from peer_venvs import build_peer_venv  # scripts/: this script's own folder

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "tests" / "data" / "gptq_toy"
PEERS = {
    # name: (venv name, packages, label)
    "modelopt": (".venv-modelopt", ["nvidia-modelopt[hf]==0.47.0"], "ModelOpt 0.47.0 auto_quantize (gradient)"),
    "modelopt_kl": (".venv-modelopt", ["nvidia-modelopt[hf]==0.47.0"], "ModelOpt 0.47.0 auto_quantize (kl_div)"),
    "autoround": (".venv-autoround", ["auto-round==0.16.1"], "auto-round 0.16.1 AutoScheme"),
}
# What the recipes keep BF16 among the main model's nn.Linear modules (the MTP layer transformers never builds).
KEEP = re.compile(r"^lm_head$|\.mlp\.gate$|\.indexer\.(wk|weights_proj)$")
TREATMENTS = ("scheme", "mxfp8", "fp8", "bf16")  # this tool's user-recipe words: MXFP4 (the scheme), ..., BF16


# ---------------------------------------------------------------------------------------------------- peer venvs

def peer_venv(name: str, root: Path) -> Path | None:
    """The python of the peer's venv under `root`, built on first use (scripts/peer_venvs.py)."""
    venv_name, packages, label = PEERS[name]
    return build_peer_venv(root / venv_name, packages, label)


# ------------------------------------------------------------------------------------------ peer workers (venvs)

def _load(src: Path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the MTP layer's tensors are "unexpected" to transformers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)


def _over_all_linears(model, bits: float) -> float:
    """`bits` over the searched linears as the peers count it: both ModelOpt's effective bits (its log's
    "AutoQuantize effective bits") and auto-round's avg_bits (base.py "AutoScheme final avg_bits") divide by every
    nn.Linear of the model, the ones kept BF16 here (lm_head, wk, weights_proj) at 16 bits."""
    import torch

    linears = {n: m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    kept = sum(v for n, v in linears.items() if KEEP.search(n))
    return (bits * (sum(linears.values()) - kept) + 16 * kept) / sum(linears.values())


def _expert_names(model, parent: str) -> list[str]:
    """The per-expert linear names this tool's manifests use for a fused transformers experts module."""
    n = model.config.n_routed_experts
    return [f"{parent}.{e}.{p}" for e in range(n) for p in ("gate_proj", "up_proj", "down_proj")]



class _TorchMx:
    """Stands in for ModelOpt's CUDA extension modelopt_cuda_ext_mx (tensor_quant.py's MX fake quantization calls
    get_cuda_ext_mx(raise_if_failed=True), which raises without CUDA): OCP MX fake quantization in torch, each block
    of `block_size` along the last dim scaled by 2^(floor(log2(amax_block)) - emax) (E8M0), its elements rounded to
    nearest even on the E2M1 / E4M3 grid and saturated."""

    class Types:
        E2M1, E4M3, E8M0 = "E2M1", "E4M3", "E8M0"

    FORMATS = {"E2M1": (2, 1, 6.0), "E4M3": (8, 3, 448.0)}  # emax, mantissa bits, largest value (min exp 1-bias)
    MIN_EXP = {"E2M1": 0, "E4M3": -6}

    @classmethod
    def fused_amax_convert(cls, inputs, block_size, element, scale, amax=None):
        import torch

        if scale != "E8M0" or element not in cls.FORMATS:
            raise NotImplementedError(f"torch MX shim: {element} with {scale} scales")
        emax, mbits, top = cls.FORMATS[element]
        x = inputs.float().reshape(-1, block_size)
        block_amax = x.abs().amax(-1, keepdim=True)
        exp = torch.where(block_amax > 0, torch.floor(torch.log2(block_amax.clamp_min(2.0 ** -126))) - emax, 0)
        scaled = x / torch.exp2(exp.clamp(-127, 127))
        e = torch.floor(torch.log2(scaled.abs().clamp_min(2.0 ** -30))).clamp_min(cls.MIN_EXP[element])
        step = torch.exp2(e - mbits)
        q = (torch.round(scaled / step) * step).clamp(-top, top)
        return (q * torch.exp2(exp.clamp(-127, 127))).reshape(inputs.shape).to(inputs.dtype)


def modelopt_worker(src: Path, windows: Path, bits: float, out: Path, method: str = "gradient") -> dict:
    import torch
    import torch.nn.functional as F

    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization import tensor_quant

    tensor_quant.get_cuda_ext_mx = lambda raise_if_failed=False: _TorchMx  # the CUDA-only MX kernel, in torch

    model = _load(src)
    ids = torch.load(windows)
    batches = [ids[i:i + 8] for i in range(0, len(ids), 8)]

    def weight_only(cfg: dict, bits_stored: float) -> dict:
        cfg = copy.deepcopy(cfg)
        cfg["quant_cfg"] = [e for e in cfg["quant_cfg"] if "input_quantizer" not in e.get("quantizer_name", "")]
        cfg["effective_bits"] = bits_stored  # this tool's stored bits (scales included), not ModelOpt's E+M+1
        return cfg

    formats = [weight_only(mtq.MXFP4_DEFAULT_CFG, 4.25), weight_only(mtq.MXFP8_DEFAULT_CFG, 8.25),
               weight_only(mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG, 8.25)]

    def forward_step(model, batch):
        return model(input_ids=batch).logits

    def loss_func(output, batch):
        return F.cross_entropy(output[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())

    t0 = time.perf_counter()
    model, state = mtq.auto_quantize(
        model, constraints={"effective_bits": _over_all_linears(model, bits)}, quantization_formats=formats,
        data_loader=batches, forward_step=forward_step, loss_func=loss_func if method == "gradient" else None,
        disabled_layers=["*lm_head*", "*mlp.gate", "*indexer.wk", "*indexer.weights_proj"],
        num_calib_steps=len(batches), num_score_steps=len(batches), method=method, verbose=True)
    seconds = time.perf_counter() - t0
    picks = {}
    for name, module in model.named_modules():
        # A linear's weight_quantizer; fused experts' gate_up_proj_weight_quantizers (one per expert) and down's.
        quantizers = [q for a, q in vars(module).get("_modules", {}).items()
                      if a.endswith(("weight_quantizer", "weight_quantizers"))]
        if not quantizers or not name.startswith("model.layers."):
            continue
        q = quantizers[0][0] if isinstance(quantizers[0], torch.nn.ModuleList) else quantizers[0]
        if not q.is_enabled:
            treatment = "bf16"
        elif tuple(q.num_bits) == (2, 1):
            treatment = "scheme"
        elif tuple(q.num_bits) == (4, 3):
            treatment = "mxfp8" if q.block_sizes else "fp8"
        else:
            raise SystemExit(f"{name}: unexpected weight quantizer {q}")
        if KEEP.search(name):
            if treatment != "bf16":
                raise SystemExit(f"{name}: disabled for the search, but picked {treatment}")
            continue
        for target in (_expert_names(model, name) if name.endswith("mlp.experts") else [name]):
            picks[target] = treatment
    (out / "state.txt").write_text(repr({k: v for k, v in state.items() if k != "candidate_stats"})[:20000])
    return {"seconds": seconds, "picks": picks}


def autoround_worker(src: Path, windows: Path, bits: float, out: Path) -> dict:
    import torch
    from transformers import AutoTokenizer

    from auto_round import AutoRound, AutoScheme
    from auto_round.schemes import QuantizationScheme

    model = _load(src)
    tokenizer = AutoTokenizer.from_pretrained(src)
    ids = torch.load(windows)
    # Weight-only MXFP4 / MXFP8 (auto-round's presets of those names also quantize activations), and BF16.
    options = [QuantizationScheme.from_dict({"bits": b, "group_size": 32, "data_type": "mx_fp", "act_bits": 16})
               for b in (4, 8)] + ["BF16"]
    keep = {n: {"bits": 16, "act_bits": 16} for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and KEEP.search(n)}
    # AutoScheme takes a dataset name or a local json/jsonl file only (gen_auto_scheme.py, _check_configs): the
    # same windows, decoded back to text (the toy's tokenizer is byte-level), which auto-round re-tokenizes.
    texts = out / "calib_windows.jsonl"
    texts.write_text("".join(json.dumps({"text": tokenizer.decode(r.tolist())}) + "\n" for r in ids))
    avg_bits = _over_all_linears(model, bits)
    t0 = time.perf_counter()
    scheme = AutoScheme(avg_bits=avg_bits, options=options, nsamples=len(ids), seqlen=ids.shape[1], batch_size=8)
    rounder = AutoRound(model, tokenizer, scheme=scheme, iters=0, dataset=str(texts),
                        nsamples=len(ids), seqlen=ids.shape[1], layer_config=keep, enable_torch_compile=False)
    rounder.quantize()
    seconds = time.perf_counter() - t0
    picks = {}
    for name, cfg in rounder.layer_config.items():
        if KEEP.search(name) or not name.startswith("model.layers."):
            continue
        b = cfg.get("bits", 16)
        treatment = {4: "scheme", 8: "mxfp8", 16: "bf16"}[b]
        if b != 16 and cfg.get("data_type") != "mx_fp":
            raise SystemExit(f"{name}: unexpected pick {cfg}")
        picks[name] = treatment
    (out / "layer_config.json").write_text(json.dumps(rounder.layer_config, indent=1, default=str))
    return {"seconds": seconds, "picks": picks}


def peer_worker(name: str, src: Path, windows: Path, bits: float, out: Path) -> None:
    import torch

    torch.set_num_threads(1)
    workers = {"modelopt": modelopt_worker, "autoround": autoround_worker,
               "modelopt_kl": lambda *a: modelopt_worker(*a, method="kl_div")}
    record = workers[name](src, windows, bits, out)
    (out / "record.json").write_text(json.dumps(record, indent=1))


# -------------------------------------------------------------------------------------------- main (this venv)

def budgets(work: Path, src: Path) -> tuple[dict, dict]:
    """Exports of the two reference recipes; returns ({label: this tool's effective bits B}, {label: the budget
    handed to a peer, which sees neither the MTP layer (given MXFP4 after) nor the indexer's wk (kept BF16)})."""
    from quant.pipeline.run import quantize_checkpoint

    ref = {}
    for recipe in ("experts-mxfp4-rest-mxfp8", "all-linear"):
        out = work / f"recipe-{recipe}"
        if not (out / "quant_manifest.json").is_file():
            quantize_checkpoint(src, out, recipe=recipe, check_engines=None, log=lambda m: None)
        ref[recipe] = json.loads((out / "quant_manifest.json").read_text())
    high = ref["experts-mxfp4-rest-mxfp8"]["summary"]["effective_bits"]
    low = ref["all-linear"]["summary"]["effective_bits"]
    params = {k: math.prod(v["source_shape"]) for k, v in ref["all-linear"]["tensors"].items()
              if v["action"] == "quantize" or ".indexer.wk" in k}  # the linears the effective bits count
    mtp = sum(v for k, v in params.items() if k.startswith("model.layers.2.") and ".indexer.wk" not in k)
    wk = sum(v for k, v in params.items() if ".indexer.wk" in k)
    total = sum(params.values())
    ours = {"experts-mxfp4-rest-mxfp8": high, "halfway to all-linear": round((high + low) / 2, 4)}
    peer = {k: (b * total - 4.25 * mtp - 16 * wk) / (total - mtp - wk) for k, b in ours.items()}
    return ours, peer


def recipe_text(picks: dict[str, str], note: str) -> str:
    """A user recipe: base all-linear (MXFP4 everywhere, the MTP layer included), one entry per picked linear."""
    lines = [f"# {note}", "base: all-linear", "description: " + note.replace(":", " -"), "modules:"]
    for module, treatment in sorted(picks.items()):
        if treatment not in TREATMENTS:
            raise ValueError(f"{module}: {treatment} is no recipe treatment")
        lines.append(f"  - '^(?:{re.escape(module)})$': {treatment}")
    return "\n".join(lines) + "\n"


def counts(manifest: dict) -> dict:
    """The main model's linears by stored format (layers 0-1; lm_head, routers and weights_proj left out)."""
    out: dict[str, int] = {}
    for name, rec in manifest["tensors"].items():
        module = name.removesuffix(".weight")
        if not module.startswith(("model.layers.0.", "model.layers.1.")) or len(rec["source_shape"]) != 2 \
                or re.search(r"norm|\.mlp\.gate$|weights_proj$", module):
            continue
        scheme = rec.get("scheme") or "bf16"
        label = "MXFP4" if "mxfp4" in scheme else "MXFP8" if "mxfp8" in scheme else "FP8" if "fp8" in scheme \
            else "BF16"
        out[label] = out.get(label, 0) + 1
    return dict(sorted(out.items()))


OURS = {"ours_vllm": (["vllm"], "quant search --engine vllm (the peers' formats: MXFP8 loads)"),
        "ours": (None, "quant search (default: vLLM and SGLang releases; no MXFP8 in SGLang 0.5.12)")}


def main() -> None:  # noqa: PLR0915 (the benchmark, read top to bottom)
    import torch

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", default="ours_vllm,ours,modelopt,modelopt_kl,autoround")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-search-peers"))
    parser.add_argument("--venvs", type=Path, default=Path("/work/main"), help="where the peers' venvs live")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "tests"))
    from test_gptq import gptq_toy_heldout  # noqa: E402 (the suite's own)

    from evals.arms.nll import mean_nll
    from quant.gptq.calibration import CalibrationSettings, calibration_tokens
    from quant.pipeline.run import quantize_checkpoint
    from quant.search.run import search
    from quant.verify import verify_checkpoint

    src, work = TOY / "model", args.work
    work.mkdir(parents=True, exist_ok=True)
    calib = CalibrationSettings(str(TOY / "calib.jsonl"), samples=128, seq_len=128)
    windows = work / "calib.pt"
    torch.save(calibration_tokens(calib, src), windows)
    texts = gptq_toy_heldout(windows=10**6)
    ours_bits, peer_bits = budgets(work, src)
    bf16 = mean_nll(src, texts)
    print(f"BF16 held-out NLL {bf16:.5f} over {len(texts)} windows; budgets {ours_bits} "
          f"(peers, over the main model's searched linears: {peer_bits})", flush=True)
    rows = []
    for budget, bits in ours_bits.items():
        for peer in args.peers.split(","):
            tag = f"{peer}-{bits}"
            out = work / tag
            t0 = time.perf_counter()
            if peer in OURS:
                result = search(src, OURS[peer][0], calib, bits=bits, log=lambda m: None)
                seconds = process = time.perf_counter() - t0
                text = result["recipe_yaml"]
                label = OURS[peer][1]
            else:
                python = peer_venv(peer, args.venvs)
                if python is None:
                    continue
                out.mkdir(parents=True, exist_ok=True)
                proc = subprocess.run([str(python), __file__, "--peer-worker", peer, str(src), str(windows),
                                       repr(peer_bits[budget]), str(out)], capture_output=True, text=True,
                                      env={**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"})
                (out / "worker.log").write_text(proc.stdout + proc.stderr)
                label = PEERS[peer][2]
                if proc.returncode != 0 or not (out / "record.json").is_file():
                    last = [x for x in (proc.stderr or proc.stdout).strip().splitlines() if x.strip()][-1:] or ["?"]
                    print(f"{label} at {bits} bits: failed ({last[0][:300]}; see {out / 'worker.log'})", flush=True)
                    continue
                record = json.loads((out / "record.json").read_text())
                seconds, process = record["seconds"], time.perf_counter() - t0
                text = recipe_text(record["picks"], f"{label}, budget {bits} effective bits")
            recipe = work / f"{tag}.yaml"
            recipe.write_text(text)
            export = work / f"export-{tag}"
            quantize_checkpoint(src, export, recipe=str(recipe), check_engines=None, log=lambda m: None)
            manifest = json.loads((export / "quant_manifest.json").read_text())
            nll = mean_nll(export, texts)
            report = verify_checkpoint(export)  # the serving releases, as verify-manifest checks by default
            refused = sorted({f"{f.engine} {v}" for f in report.errors for v in f.versions})
            row = {"refused_by": refused, "peer": label, "budget": budget, "bits": bits,
                   "effective_bits": manifest["summary"]["effective_bits"], "pick": counts(manifest),
                   "bytes": manifest["summary"]["output_bytes"], "nll": nll,
                   "rise": nll - bf16, "search_s": round(seconds, 1), "process_s": round(process, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (work / "results.json").write_text(json.dumps({"bf16_nll": bf16, "rows": rows}, indent=1))
    print("\n| peer | budget (effective bits) | its pick (main-model linears) | export bytes | effective bits | "
          "held-out NLL | rise over BF16 | search wall s | releases that refuse the export |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| BF16 source | | | | 16 | {bf16:.5f} | | | |")
    for r in rows:
        pick = ", ".join(f"{k} {v}" for k, v in r["pick"].items())
        print(f"| {r['peer']} | {r['bits']} ({r['budget']}) | {pick} | {r['bytes']} | {r['effective_bits']} | "
              f"{r['nll']:.5f} | {r['rise']:+.5f} | {r['search_s']} | {', '.join(r['refused_by']) or 'none'} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--peer-worker":
        _, _, name, src, windows, bits, out = sys.argv
        peer_worker(name, Path(src), Path(windows), float(bits), Path(out))
    else:
        main()
