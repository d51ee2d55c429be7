"""Where an eval writes, and what it refuses to write over: --out claimed for this eval (quant.ownership: a
directory of someone else's, or an input inside it, is refused; a second eval into it is locked out), what an
earlier eval of ours left there removed, --write-gate's target checked, and a candidate compared with its own
model refused (by content) before any work."""

from __future__ import annotations

from pathlib import Path

from evals.arms.answers import ANSWERS_DIR, checkpoint_digest, same_model, server_identity
from evals.arms.backends import endpoint_url, is_url, served_models
from evals.report.render import REPORT_JSON
from evals.request import EvalRequest, same_source
from quant.errors import QuantError
from quant.ownership import check_new_file, claim, remove_path

# What an eval leaves in OUT: the per-question samples of each arm, and the report (report.json last).
RUNS_DIR = "runs"
OWN_FILES = (REPORT_JSON, "report.md", "report.png")
# Everything else (the task files, the data, lm-eval's datasets cache, the backends' work space, and the runs
# while they are under way) lives in a scratch directory of ours (quant.ownership.SCRATCH).
SCRATCH_DIR = ".quant-eval"


def claim_out(request: EvalRequest):
    inputs = {"candidate": None if is_url(request.candidate) else Path(request.candidate),
              "baseline": None if not request.baseline or is_url(request.baseline) else Path(request.baseline),
              "--data-dir": request.data_dir, "--gpqa-csv": request.gpqa_csv, "--baseline-run": request.baseline_run}
    return claim(Path(request.out), "eval", inputs=inputs, overwrite=request.overwrite, what="--out")


def prepare_out(held, resume: bool = True) -> None:
    """Refuse (before any work) a file of someone else's where this eval writes; remove what an earlier eval of
    ours left in OUT (by its owner record, only files that still hold what it wrote), report.json first so an
    unfinished run never looks finished."""
    held.require_free((RUNS_DIR, SCRATCH_DIR) + OWN_FILES)
    if held.previous is not None and held.previous.kind == "eval":
        for name in (REPORT_JSON, RUNS_DIR) + OWN_FILES[1:]:
            held.remove_ours(name)
    if held.is_scratch(SCRATCH_DIR):  # all but the kept answers (evals/arms/answers.py), which --no-resume drops
        for entry in (held.root / SCRATCH_DIR).iterdir():
            if entry.name != ANSWERS_DIR or not resume or entry.is_symlink() or not entry.is_dir():
                remove_path(entry)


def check_gate_target(request: EvalRequest) -> None:
    """--write-gate's target: a new file outside every input, or --overwrite."""

    inputs = {label: Path(source) for label, source in (("candidate checkpoint", request.candidate),
                                                         ("baseline checkpoint", request.baseline))
              if source and not is_url(source)}
    check_new_file(Path(request.write_gate), "--write-gate", inputs, request.overwrite)


def check_not_itself(request: EvalRequest, earlier) -> None:
    """Refuse, before any evaluation, a candidate compared with its own model by content, not by path: a baseline
    checkpoint byte for byte the candidate's (evals.arms.answers.checkpoint_digest), or --baseline-run answers that
    the candidate's model gave (the identity that run wrote beside them; a run from before identities were written
    is known by its baseline's path or URL)."""

    proves = "a comparison of a model with itself proves nothing"
    if request.baseline is not None:
        if is_url(request.candidate) or is_url(request.baseline):
            # two servers: by URL (evals.request.check); a server and a checkpoint: an engine's check, not a
            # self-comparison
            return
        digest = checkpoint_digest(Path(request.candidate))
        if digest == checkpoint_digest(Path(request.baseline)):
            raise QuantError(f"--candidate {request.candidate} and --baseline {request.baseline} are the same model "
                             f"(byte-identical checkpoints, sha256 {digest[:16]}); {proves}")
        return
    arm, _, recorded = earlier
    source = arm.get("source")
    if recorded is None:  # an output written before identities were: its baseline's path or URL
        same = source is not None and (arm.get("kind") == "server") == is_url(request.candidate) and \
            same_source(str(source), request.candidate)
        what = "the same path" if not is_url(request.candidate) else "the same server"
    else:
        candidate = _candidate_identity(request) if recorded.get("kind") == ("server" if is_url(request.candidate)
                                                                               else "transformers") else {}
        same = same_model(recorded, candidate)
        what = (f"the same checkpoint bytes, sha256 {str(recorded.get('checkpoint_digest'))[:16]}"
                if recorded.get("checkpoint_digest") and candidate.get("checkpoint_digest")
                else "the same server and model id")
    if same:
        raise QuantError(f"--baseline-run {request.baseline_run}: its baseline answers were given by --candidate "
                         f"{request.candidate} itself ({source}: {what}); {proves}")


def _candidate_identity(request: EvalRequest) -> dict:
    """The candidate's model as evals.arms.answers identifies it, before its arm runs."""

    if not is_url(request.candidate):
        return {"kind": "transformers", "checkpoint_digest": checkpoint_digest(Path(request.candidate))}

    url = endpoint_url(request.candidate, request.endpoint)
    model = request.server_model or served_models(url, timeout=min(30, request.timeout), flag="--candidate")[0]
    return server_identity(url, model)
