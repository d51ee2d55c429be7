"""Held-out negative log-likelihood of a checkpoint (BF16, or quantized and dequantized exactly by
`quant.dequant`): the mean next-token NLL in nats over a set of texts, computed by transformers' own model.

A finer measure than task accuracy for comparing quantization methods on small models: it moves with every weight,
where greedy accuracy moves only when an answer flips.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from quant.checkpoint import open_checkpoint
from quant.dequant import dequantize_checkpoint


def mean_nll(checkpoint: str | Path, texts: list[str] | list[tuple[str, str]], batch: int = 16,
             device: str = "cpu") -> float:
    """Mean NLL per predicted token (nats) of `checkpoint` over `texts`, each scored on its own: a string from
    its first token on, or a (context, continuation) pair on the continuation's tokens only (as lm-eval scores
    loglikelihood requests). A quantized checkpoint is dequantized to BF16 first (bit-exact weights), then run
    in fp32 on `device`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging


    checkpoint = Path(checkpoint)
    with tempfile.TemporaryDirectory(prefix="nll-") as tmp:
        path = checkpoint
        if open_checkpoint(checkpoint).quantization_config:
            path = dequantize_checkpoint(checkpoint, Path(tmp) / "bf16")
        tokenizer = AutoTokenizer.from_pretrained(path)
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # MTP layers' tensors are "UNEXPECTED" to transformers, as always
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().to(device)
        finally:
            hf_logging.set_verbosity(verbosity)
        total, count = 0.0, 0
        with torch.no_grad():
            for b in range(0, len(texts), batch):
                rows, scored_from = [], []
                for item in texts[b:b + batch]:
                    context, continuation = item if isinstance(item, tuple) else ("", item)
                    head = tokenizer(context, add_special_tokens=False)["input_ids"] if context else []
                    rows.append(head + tokenizer(continuation, add_special_tokens=False)["input_ids"])
                    scored_from.append(max(len(head), 1))  # index of the first scored token
                width = max(len(r) for r in rows)
                ids = torch.zeros(len(rows), width, dtype=torch.long)
                mask = torch.zeros(len(rows), width, dtype=torch.long)
                for i, r in enumerate(rows):
                    ids[i, :len(r)] = torch.tensor(r)
                    mask[i, scored_from[i]:len(r)] = 1
                attention = (torch.arange(width) < torch.tensor([len(r) for r in rows])[:, None]).long()
                logits = model(input_ids=ids.to(device), attention_mask=attention.to(device),
                               use_cache=False).logits.float().cpu()
                logp = torch.log_softmax(logits[:, :-1], dim=-1)
                target = ids[:, 1:]
                nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
                keep = mask[:, 1:].bool()
                total += float(nll[keep].sum())
                count += int(keep.sum())
    return total / max(count, 1)
