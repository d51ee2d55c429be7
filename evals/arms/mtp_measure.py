"""Draft acceptance of an in-process arm, measured on its own eval generations (evals/statistics/acceptance.py defines
it).

For each question the prompt (tokenized as lm-eval's HFLM did for generation) and the generated answer are run
through the target once, teacher-forced: its hidden state after the final norm and its greedy next token at every
position. The MTP draft then proposes, for every anchor in the generation, a chain of `depth` tokens the way the
engines chain it (evals/arms/mtp_draft.py): step 1 teacher-forced over the whole sequence, step j on the verified
prefix plus the chain's own earlier tokens and hidden states (the draft's KV for those positions comes from the
chain, as in the engines' draft cache).
"""

from __future__ import annotations

import numpy as np

from evals.statistics.acceptance import QuestionAcceptance, simulate


def target_pass(model, ids):
    """(hidden [1, L, H] after the final norm, greedy next tokens [L]) of the target on `ids` [1, L]."""
    import torch

    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        logits = model.get_output_embeddings()(hidden)
    return hidden, logits[0].argmax(-1)


def draft_chains(draft, ids, hidden, start: int, depth: int):
    """drafts [depth, L]: drafts[j][c] is the (j+1)-th token the draft proposes at anchor c (c >= start); -1 where
    the simulation cannot need it (a chain stops at its first draft the target rejects).

    Step 1 is one teacher-forced pass: input position t holds (x[t+1], h[t]) and drafts x[t+2], i.e. anchor t+1.
    Step j > 1 is one pass too: the teacher-forced rows followed by every live chain's j-1 tokens, a chain for
    anchor c at positions c..c+j-2 holding (d_i, the hidden its previous step returned), masked to see the
    teacher-forced rows before c and its own chain only: what the engine's draft attends to through its cache."""
    import torch

    length = ids.shape[1]
    drafts = np.full((depth, length), -1, dtype=np.int64)
    if length < 2 or start > length - 2:
        return drafts, None
    device = ids.device
    n_tf = length - 1
    tf_tokens, tf_hidden = ids[0, 1:], hidden[0, :-1]
    tf_positions = torch.arange(n_tf, device=device)
    with torch.no_grad():
        out, logits = draft(0, tf_tokens[None], tf_hidden[None], tf_positions[None])
        first = logits[0].argmax(-1)
    drafts[0, 1:] = first.cpu().numpy()
    anchors = list(range(start, length - 1))
    chains = {c: ([first[c - 1]], [out[0, c - 1]]) for c in anchors}
    return drafts, (tf_tokens, tf_hidden, tf_positions, chains)


def extend_chains(draft, drafts, state, target_next, depth: int) -> None:
    """Fill drafts[1:] for the anchors whose chain the target has accepted so far (see `draft_chains`)."""
    import torch

    if state is None:
        return
    tf_tokens, tf_hidden, tf_positions, chains = state
    n_tf = len(tf_tokens)
    device = tf_tokens.device
    for step in range(1, depth):
        live = [c for c, (tokens, _) in chains.items()
                if len(tokens) == step and c + step - 1 < len(target_next) - 1
                and drafts[step - 1, c] == target_next[c + step - 1]]
        if not live:
            return
        width = n_tf + len(live) * step
        tokens = torch.cat([tf_tokens] + [torch.stack(chains[c][0]) for c in live])
        states = torch.cat([tf_hidden] + [torch.stack(chains[c][1]).to(tf_hidden.dtype) for c in live])
        positions = torch.cat([tf_positions] + [torch.arange(c, c + step, device=device) for c in live])
        allowed = torch.zeros((width, width), dtype=torch.bool, device=device)
        allowed[:n_tf, :n_tf] = torch.ones((n_tf, n_tf), dtype=torch.bool, device=device).tril()
        for i, c in enumerate(live):
            rows = slice(n_tf + i * step, n_tf + (i + 1) * step)
            allowed[rows, :c] = True
            allowed[rows, rows] = torch.ones((step, step), dtype=torch.bool, device=device).tril()
        dtype = tf_hidden.dtype
        mask = torch.zeros((width, width), dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        with torch.no_grad():
            out, logits = draft(step, tokens[None], states[None], positions[None], attention_mask=mask[None, None])
        for i, c in enumerate(live):
            row = n_tf + (i + 1) * step - 1
            token = logits[0, row].argmax(-1)
            chains[c][0].append(token)
            chains[c][1].append(out[0, row])
            drafts[step, c] = int(token)


def measure_sequence(model, draft, prompt_ids: list[int], generated_ids: list[int], depth: int
                     ) -> QuestionAcceptance:
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(generated_ids)], dtype=torch.long, device=device)
    hidden, target_next = target_pass(model, ids)
    target_next = target_next.cpu().numpy()
    drafts, state = draft_chains(draft, ids, hidden, len(prompt_ids), depth)
    extend_chains(draft, drafts, state, target_next, depth)
    return simulate(target_next, drafts, len(prompt_ids), depth)


def measure_records(lm, draft, records: list[dict], depth: int, log=None) -> dict[tuple, QuestionAcceptance]:
    """Acceptance per generation (task, seed, doc_id) of an arm's records; `lm` is the arm's HFLM (its model and
    its own prompt encoding)."""
    model, tokenizer = lm.model, lm.tokenizer
    done: dict[tuple, QuestionAcceptance] = {}
    for r in records:
        key = (r["task"], r["seed"], r["doc_id"])
        if key in done or r.get("prompt") is None:
            continue
        prompt_ids = lm.tok_encode(r["prompt"])
        generated = tokenizer.encode(r["response"], add_special_tokens=False) if r["response"] and not r["failed"] \
            else []
        done[key] = measure_sequence(model, draft, prompt_ids, generated, depth)
        if log and len(done) % 50 == 0:
            log(f"    MTP acceptance: {len(done)} generations")
    return done
