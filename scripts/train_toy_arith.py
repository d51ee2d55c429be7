"""Train the toy arithmetic model behind the eval stage's end-to-end test (evals/data/toy_arith/model).

The model is the GLM-5 toy (`quant.toy.build_toy("glm5")`: MLA attention with the DSA indexer, a dense layer, a
MoE layer with shared expert, and the MTP layer) with eval-friendly dimensions, trained on CPU from a fixed seed
on a GSM8K-format task of its own:

    Question: What is 47 + 8?
    Answer: 47 + 8 = 55
    #### 55

Training rows are laid out exactly like lm-eval's GSM8K few-shot prompts (examples joined by a blank line, each
row ending with the next "Question:", the task's stop sequence). The first 60% of the steps use one-question
rows (cheap; this is where the task is learnt), the rest rows of 2-6 questions, so the model answers the last
question of a 5-shot prompt. From 60% on, every quantizable weight (attention, dense MLP, shared and routed
experts) is replaced on half of the steps by its MXFP4 quantize-dequantize (straight-through gradient), with
weight decay throughout, so the correct MXFP4 export keeps the accuracy while a broken one (swapped nibbles,
wrong scales) does not. The 200 test questions are held out from training.

Then the MTP layer (model.layers.2, which transformers never runs) is trained with the main model frozen: the
draft head of evals/arms/mtp_draft.py (the engines' MTP forward) on the target's own hidden states, cross-entropy on
x[t+2] over the answer tokens (DeepSeek-V3's MTP loss at depth 1), the embedding and output head shared with the
target and frozen, as in the engines. `--mtp-only` runs just this stage on the existing checkpoint (its main
weights stay byte-identical).

Writes evals/data/toy_arith/{train,test}.jsonl and the checkpoint (BF16 safetensors, config, tokenizer). Then
scores it through the eval stage's own lm-eval pipeline: greedy accuracy, and the MTP draft's acceptance on the
held-out questions (evals/statistics/acceptance.py).

    python scripts/train_toy_arith.py              # about 4-5 minutes on 2 CPU cores; byte-identical reruns
    python scripts/train_toy_arith.py --mtp-only   # retrain only the MTP layer of the existing checkpoint
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = REPO / "evals" / "data" / "toy_arith"
FIXTURE_DIR = DATA_DIR / "model"
TEST_QUESTIONS = 200

# Every quantized Linear has an input dimension divisible by 32 (the MXFP4 block). index_topk above the longest
# prompt makes the DSA indexer select every token, i.e. dense causal attention.
MODEL_OVERRIDES = {
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "head_dim": 32,
    "index_n_heads": 1,
    "index_head_dim": 32,
    "index_topk": 2048,
    "max_position_embeddings": 2048,
}
# Weights a recipe may quantize: attention projections, dense MLP, shared and routed experts (not the router,
# the indexer, embeddings or lm_head).
QUANTIZABLE = re.compile(r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight$"
                         r"|mlp\.(gate_proj|up_proj|down_proj)\.weight$"
                         r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$"
                         r"|mlp\.experts\.(gate_up_proj|down_proj)$")


def make_example(a: int, b: int) -> dict:
    return {"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}


def write_data(data_dir: Path, seed: int) -> tuple[list[dict], list[dict]]:
    """All a + b with a in 10..99 and b in 1..9; the first TEST_QUESTIONS of a seeded shuffle are the test set."""
    pairs = [(a, b) for a in range(10, 100) for b in range(1, 10)]
    random.Random(seed).shuffle(pairs)
    test, train = [make_example(*p) for p in pairs[:TEST_QUESTIONS]], [make_example(*p) for p in pairs[TEST_QUESTIONS:]]
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        with open(data_dir / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return train, test


def training_row(examples: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of examples laid out as lm-eval's few-shot prompt, and a loss mask that skips the question
    (its operands are random; everything else is predictable). Every row ends with the next "Question:", the
    stop sequence of the GSM8K task, so the model ends its answer there."""
    ids, mask = [], []
    pieces = []
    for ex in examples:
        pieces += [("Question: ", 1), (ex["question"], 0), ("\nAnswer: " + ex["answer"] + "\n\n", 1)]
    for text, learn in pieces + [("Question:", 1)]:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        ids += tokens
        mask += [learn] * len(tokens)
    return ids, mask


def batch(rows: list[tuple[list[int], list[int]]], pad: int):
    """(input ids, labels) [rows, width] of `training_row`s: right-padded, labels -100 where the mask is 0."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    x = torch.full((len(rows), width), pad, dtype=torch.long)
    y = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        x[i, :len(ids)] = torch.tensor(ids)
        y[i, :len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
    return x, y


class FakeMXFP4:
    """Parametrization: the weight as its MXFP4 quantize-dequantize in the forward pass, identity gradient."""

    enabled = False

    @staticmethod
    def module():
        import torch

        from quant.numerics.mxfp4 import dequantize_mxfp4, quantize_mxfp4

        class Module(torch.nn.Module):
            def forward(self, w):
                if not FakeMXFP4.enabled:
                    return w
                with torch.no_grad():
                    q = dequantize_mxfp4(*quantize_mxfp4(w.detach(), compiled=False), dtype=w.dtype)
                return w + (q - w).detach()

        return Module()


def zero_routed_expert_outputs(model) -> None:
    """Start every MoE layer as its shared expert alone: the routed experts' down projections begin at zero (they
    still get gradients). Random routed outputs on top of an untrained residual stream delay, by hundreds of steps,
    the moment the attention learns to find the question's digits."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.experts.down_proj"):
                p.zero_()


def step_shape(step: int, steps: int, examples: int, short_fraction: float, rng: random.Random) -> tuple[int, int]:
    """(examples per row, rows) of a step. Short rows (one example) are cheap and teach the task; the last part
    mixes rows of 2-6 examples (half as many questions per step: long rows cost more per token) so the model
    answers the last question of a long few-shot prompt."""
    if step < short_fraction * steps:
        return 1, examples
    shots = rng.randint(2, 6)
    return shots, max(1, -(-examples // (2 * shots)))


def text_windows(path: Path, tokenizer, width: int) -> list[list[int]]:
    """Token windows of natural text for `--text`: the question and answer of every record of a GSM8K-format
    JSONL file, joined and cut into `width`-token pieces."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ids = tokenizer.encode("\n\n".join(f"{r['question']}\n{r['answer']}" for r in rows), add_special_tokens=False)
    return [ids[i:i + width] for i in range(0, len(ids) - width + 1, width)]


def train(model, tokenizer, train_rows: list[dict], *, steps: int, examples: int, short_fraction: float, lr: float,
          qat_from: float, seed: int, weight_decay: float = 0.1, text: list[list[int]] | None = None,
          text_rows: int = 8, log=print) -> None:
    """`text`: token windows of natural text, `text_rows` of them trained on at every step beside the task (a
    model that must also predict text is not saturated, so quantization shows in its held-out NLL)."""
    import torch
    from torch.nn.utils import parametrize

    rng = random.Random(seed)
    torch.manual_seed(seed)
    zero_routed_expert_outputs(model)
    quantizable = [(module, leaf) for name, _ in model.named_parameters() if QUANTIZABLE.search(name)
                   for module, leaf in [(model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1])]]
    for module, leaf in quantizable:
        parametrize.register_parametrization(module, leaf, FakeMXFP4.module())
    params = list(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": weight_decay},
                             {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))
    pad = tokenizer.pad_token_id
    warmup = max(1, steps // 50)
    model.train()
    start = time.time()
    for step in range(steps):
        shots, n_rows = step_shape(step, steps, examples, short_fraction, rng)
        x, y = batch([training_row(rng.sample(train_rows, shots), tokenizer) for _ in range(n_rows)], pad)
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr * max(scale, 0.05)
        FakeMXFP4.enabled = step >= qat_from * steps and rng.random() < 0.5
        loss = model(input_ids=x, attention_mask=(x != pad).long(), labels=y).loss
        if text:
            windows = torch.tensor(rng.sample(text, text_rows))
            text_loss = model(input_ids=windows, labels=windows).loss
            (loss + text_loss).backward()
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0 or step == 0:
            log(f"step {step + 1}/{steps}  rows {n_rows}x{shots}  loss {loss.item():.4f}  "
                + (f"text loss {text_loss.item():.4f}  " if text else "") + f"{time.time() - start:.0f}s"
                + ("  (MXFP4 fake-quant)" if FakeMXFP4.enabled else ""))
    FakeMXFP4.enabled = False
    for module, leaf in quantizable:
        parametrize.remove_parametrizations(module, leaf, leave_parametrized=False)
    model.eval()


def train_mtp(model, tokenizer, draft, train_rows: list[dict], *, steps: int, examples: int, lr: float, seed: int,
              log=print) -> None:
    """Train the MTP draft's layer on the frozen target's hidden states: predict x[t+2] from (h[t], x[t+1])."""
    import torch

    rng = random.Random(seed + 1)
    torch.manual_seed(seed + 1)
    for p in model.parameters():
        p.requires_grad_(False)
    layer = draft.layers[0]
    for p in (*layer.decoder.embed_tokens.parameters(), *layer.head.parameters()):
        p.requires_grad_(False)  # shared with the target in the engines
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    pad = tokenizer.pad_token_id
    warmup = max(1, steps // 50)
    draft.train()
    start = time.time()
    for step in range(steps):
        shots = rng.randint(1, 6)
        n_rows = max(1, -(-examples // shots))
        x, y = batch([training_row(rng.sample(train_rows, shots), tokenizer) for _ in range(n_rows)], pad)
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=x, attention_mask=(x != pad).long()).last_hidden_state
        positions = torch.arange(x.shape[1] - 1)[None].expand(n_rows, -1)
        _, logits = draft(0, x[:, 1:], hidden[:, :-1], positions)
        # the output at position t drafts x[t+2]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                                 y[:, 2:].reshape(-1), ignore_index=-100)
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr * max(scale, 0.05)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % 50 == 0 or step == 0:
            log(f"MTP step {step + 1}/{steps}  rows {n_rows}x{shots}  loss {loss.item():.4f}  "
                f"{time.time() - start:.0f}s")
    draft.eval()


def mtp_tensors(draft, checkpoint: Path) -> dict:
    """The trained MTP layer's tensors under the checkpoint's names and dtypes."""
    from safetensors.torch import load_file

    from evals.arms.mtp_draft import block_tensors, draft_layers

    stored = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        stored.update(load_file(shard))
    config = json.loads((checkpoint / "config.json").read_text())
    names = draft_layers(config, stored)[0]
    layer = draft.layers[0]
    block = {n: t for n, t in stored.items() if n.startswith(names.block)
             and n[len(names.block):].split(".")[0] not in names.glue}
    state = {k: v.detach() for k, v in layer.decoder.state_dict().items()}
    out = block_tensors(state, names, block)
    out[names.final_norm + ".weight"] = state["norm.weight"]
    for module, name in ((layer.embed_norm, names.embed_norm), (layer.hidden_norm, names.hidden_norm),
                         (layer.proj, names.proj)):
        out[name + ".weight"] = module.weight.detach()
    return {n: t.to(stored[n].dtype).contiguous() for n, t in out.items()}


def save_checkpoint(model, toy_dir: Path, out: Path) -> None:
    """The toy checkpoint with the trained weights: every tensor transformers holds is replaced; the MTP layer
    (which transformers does not build) is trained afterwards (`mtp_stage`)."""
    from safetensors.torch import load_file

    from quant.toy import write_safetensors

    tensors = {}
    for shard in sorted(toy_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # per-expert names, as on disk
        trained = {}
        for shard in sorted(Path(tmp).glob("*.safetensors")):
            trained.update(load_file(shard))
    unknown = sorted(set(trained) - set(tensors))
    if unknown:
        raise SystemExit(f"trained model has tensors the toy lacks: {unknown[:3]}")
    for name, value in trained.items():
        tensors[name] = value.to(tensors[name].dtype)
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(toy_dir, staging, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    write_safetensors(tensors, staging, None)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)


def score(checkpoint: Path, limit: int, depth: int = 3, log=print) -> tuple[float, tuple[float, float] | None]:
    """Greedy 5-shot accuracy (flexible-extract) through the eval stage's own lm-eval pipeline, and the MTP draft's
    (depth-1 acceptance, mean accepted length at `depth`) on the same generations."""
    from evals.statistics.acceptance import rates
    from evals.arms.backends import BackendOptions, open_backend
    from evals.arms.mtp_measure import measure_records
    from evals.arms.lm_eval_run import RunSettings, go_offline, run_arm
    from evals.arms.tasks import write_task_files
    from evals.tasks.registry import registry

    spec = registry()["toy_arith"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        task_dir = write_task_files(tmp / "tasks", [spec], data={spec.data: DATA_DIR}, datasets_cache=tmp / "cache")
        go_offline(tmp / "cache")
        backend = open_backend(str(checkpoint), "trained", BackendOptions(batch_size=32), tmp / "work")
        records = run_arm(backend, [spec], task_dir, tmp / "runs", RunSettings(limit=limit, max_gen_toks=24, seeds=1),
                          log=log)
    primary = [r for r in records if r["filter"] == spec.primary_filter]
    acceptance = None
    if backend.draft is not None:
        measured = measure_records(backend.lm, backend.draft, primary, depth)
        acceptance = rates([q.to_json() for q in measured.values()])
    return sum(r["score"] for r in primary) / len(primary), acceptance


def replace_tensors(checkpoint: Path, replace: dict) -> None:
    """Rewrite the checkpoint's safetensors with `replace` swapped in (same names, dtypes and order)."""
    from safetensors.torch import load_file

    from quant.toy import write_safetensors

    tensors = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(shard))
    for name, value in replace.items():
        if name not in tensors or tensors[name].shape != value.shape:
            raise SystemExit(f"{checkpoint}: cannot replace {name}")
        tensors[name] = value
    staging = checkpoint.with_name(checkpoint.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(checkpoint, staging, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    write_safetensors(tensors, staging, None)
    shutil.rmtree(checkpoint)
    staging.rename(checkpoint)


def mtp_stage(checkpoint: Path, train_rows: list[dict], args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evals.arms.mtp_draft import load_draft

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    draft = load_draft(checkpoint, dtype=torch.float32)
    start = time.time()
    train_mtp(model, tokenizer, draft, train_rows, steps=args.mtp_steps, examples=args.examples, lr=args.mtp_lr,
              seed=args.seed, log=lambda m: print(m, flush=True))
    print(f"MTP layer trained in {time.time() - start:.0f}s", flush=True)
    replace_tensors(checkpoint, mtp_tensors(draft, checkpoint))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FIXTURE_DIR)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--examples", type=int, default=32, help="questions per step")
    parser.add_argument("--short-fraction", type=float, default=0.6,
                        help="fraction of steps on one-question rows before few-shot rows")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--qat-from", type=float, default=0.6, help="fraction of steps after which fake-quant starts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--text", type=Path, help="GSM8K-format JSONL whose text is also trained on (natural-text "
                        "windows beside the task; scripts/bench_gptq.py uses GSM8K's training set)")
    parser.add_argument("--text-width", type=int, default=256, help="tokens per --text window")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-limit", type=int, default=200)
    parser.add_argument("--mtp-steps", type=int, default=600)
    parser.add_argument("--mtp-lr", type=float, default=2e-3)
    parser.add_argument("--mtp-only", action="store_true", help="train only the MTP layer of the checkpoint in --out")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from quant.toy import build_toy

    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()  # the MTP layer's tensors are "UNEXPECTED" to transformers, as always
    train_rows, _ = write_data(args.data_dir, args.seed)
    if args.mtp_only:
        mtp_stage(args.out, train_rows, args)
        return report(args)
    with tempfile.TemporaryDirectory() as tmp:
        toy_dir = build_toy("glm5", Path(tmp) / "toy", seed=args.seed, overrides=MODEL_OVERRIDES)
        tokenizer = AutoTokenizer.from_pretrained(toy_dir)
        model = AutoModelForCausalLM.from_pretrained(toy_dir, dtype=torch.float32)
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
              f"{len(train_rows)} training questions", flush=True)
        start = time.time()
        train(model, tokenizer, train_rows, steps=args.steps, examples=args.examples,
              short_fraction=args.short_fraction, lr=args.lr, qat_from=args.qat_from, seed=args.seed,
              weight_decay=args.weight_decay,
              text=text_windows(args.text, tokenizer, args.text_width) if args.text else None,
              log=lambda m: print(m, flush=True))
        print(f"trained in {time.time() - start:.0f}s", flush=True)
        save_checkpoint(model, toy_dir, args.out)
    mtp_stage(args.out, train_rows, args)
    return report(args)


def report(args) -> int:
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB)", flush=True)
    accuracy, acceptance = score(args.out, args.eval_limit, log=lambda m: None)
    print(f"greedy 5-shot accuracy (flexible-extract) on {args.eval_limit} test questions: {accuracy:.3f}", flush=True)
    if acceptance:
        print(f"MTP draft on the same generations: depth-1 acceptance {acceptance[0]:.3f}, mean accepted length "
              f"{acceptance[1]:.2f} at depth 3", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
