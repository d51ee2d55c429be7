"""The two ways a model is evaluated: an OpenAI-compatible server (SGLang, vLLM, evals.arms.model_server) through
lm-eval's local-completions / local-chat-completions, or a checkpoint run in this process by transformers through HFLM.

In process, a quantized checkpoint (Quark MXFP4, Quark FP8, block FP8) is first dequantized into a plain BF16
copy by `quant.dequant.dequantize_checkpoint`, so its weights hold the quantized values (MXFP4 exactly; FP8 times
its scale rounded to BF16). Activations: with `activations="emulate"` (the default where the scheme quantizes
them) each quantized linear's input is quantized and dequantized as the checkpoint's quantization_config says
(`quant.dequant.emulate_activations`: MXFP4 / MXFP8 blocks of 32, per-token(-group) FP8), as amd-quark's emulation
does; with "bf16" (and for weight-only schemes) they stay BF16, the weights-only emulation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from quant.errors import QuantError
from quant.families import family_for_config
from quant.process import usable_cpu_attention

# What a request that failed after every retry is recorded as: no digits and no "(X)" letter, so every lm-eval
# filter extracts nothing and the answer is scored wrong, and the report can count it.
FAILED_GENERATION = "[generation failed after retries]"
ENDPOINTS = {"completions": "completions", "chat": "chat/completions"}
DTYPES = ("bfloat16", "float32", "float64")
ACTIVATIONS = ("emulate", "bf16")  # quant.dequant.ACTIVATION_MODES; None: emulate where the scheme quantizes them
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendOptions:
    endpoint: str = "completions"     # server: "completions" or "chat"
    server_model: str | None = None   # server: model name to send; None: the first of GET /v1/models
    concurrency: int = 8
    max_retries: int = 3
    timeout: int = 3600
    max_gen_toks: int = 512           # server default when a task does not set max_gen_toks
    batch_size: int = 16              # in process
    device: str | None = None         # in process; None: cuda if available, else cpu
    dtype: str = "bfloat16"           # in process
    mtp: bool = True                  # measure MTP draft acceptance (in process: build the draft; servers: read it)
    activations: str | None = None    # in process: "emulate" | "bf16"; None: emulate where the scheme quantizes them


@dataclass
class Backend:
    label: str                 # "baseline" or "candidate"
    source: str                # the checkpoint path or URL the user gave
    kind: str                  # "server" or "transformers"
    lm: object                 # an lm_eval.api.model.LM
    chat: bool = False
    description: str = ""      # e.g. "transformers on cpu (BF16 51, MXFP4 30 weight tensors, dequantized ...)"
    notes: list[str] = field(default_factory=list)
    draft: object = None       # in process: the checkpoint's MTP draft (evals.arms.mtp_draft.MtpDraft), if it has one
    draft_note: str = ""       # why there is no draft, when there is none
    activations: str = "bf16"  # in process: "emulate" (inputs quantize-dequantized) or "bf16"; servers: "server"

    def seed_gen_kwargs(self, seed: int) -> dict:
        """Extra generation kwargs that make sampling follow `seed`. Servers take it in the request payload;
        in process the torch seed (set by simple_evaluate) drives sampling, and HF generate rejects `seed`."""
        return {"seed": seed} if self.kind == "server" else {}

    def failures(self) -> int:
        return getattr(self.lm, "failed_requests", 0)

    def first_error(self) -> str | None:
        return getattr(self.lm, "first_error", None)


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def open_backend(source: str, label: str, options: BackendOptions, work_dir: Path) -> Backend:
    if is_url(source):
        return _server_backend(source, label, options)
    return _transformers_backend(Path(source), label, options, work_dir)


# ---------------------------------------------------------------------------------------------- server


def endpoint_url(base: str, endpoint: str) -> str:
    """`http://h:p/v1` -> `http://h:p/v1/completions` (or chat/completions); a full endpoint URL is kept."""
    if endpoint not in ENDPOINTS:
        raise QuantError(f"--endpoint {endpoint!r}: choose from {', '.join(ENDPOINTS)}")
    base = base.rstrip("/")
    if base.endswith(("/completions", "/chat/completions")):
        return base
    return f"{base}/{ENDPOINTS[endpoint]}"


def api_root(base: str) -> str:
    base = base.rstrip("/")
    for tail in ("/chat/completions", "/completions"):
        if base.endswith(tail):
            return base[: -len(tail)]
    return base


def served_models(base: str, timeout: float = 30.0, flag: str = "server") -> list[str]:
    """The model ids the server lists at GET <root>/models (an OpenAI-compatible server's own answer)."""
    url = f"{api_root(base)}/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = json.load(response)
        models = [str(m["id"]) for m in data.get("data") or []]
    except (urllib.error.URLError, OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        reason = " ".join(str(getattr(e, "reason", None) or e).split())[:200]
        raise QuantError(f"{flag} {url}: not an OpenAI-compatible server answering GET /models ({reason}); is the "
                         f"server up?") from None
    if not models:
        raise QuantError(f"{flag} {url}: the server lists no model")
    return models


def served_model_name(base: str, timeout: float = 30.0) -> str:
    """The first model id the server lists at GET <root>/models."""
    return served_models(base, timeout)[0]


def _checked(answers, n: int):
    """A generation response must hold one answer per prompt; anything else is a failed request (retried, then
    counted), not a crash in lm-eval's zip."""
    if isinstance(answers, dict):  # the synchronous path returns the raw JSON
        choices = answers.get("choices")
        if not isinstance(choices, list) or len(choices) != n:
            raise ValueError(f"response has {len(choices) if isinstance(choices, list) else 'no'} choices for "
                             f"{n} prompt(s)")
    elif not isinstance(answers, list) or len(answers) != n:
        raise ValueError(f"response has {len(answers) if isinstance(answers, list) else 'no'} answers for {n} "
                         f"prompt(s)")
    return answers


class _RetryingCalls:
    """Retries each request itself and, when every attempt failed, records FAILED_GENERATION for its prompts
    instead of aborting the whole evaluation (lm-eval would re-raise). lm-eval's own retry is set to 1 attempt."""

    attempts = 3
    failed_requests = 0
    first_error: str | None = None
    prompts_per_call = None  # chat: one conversation per request, whatever `messages` holds

    def _prompts(self, messages) -> int:
        return self.prompts_per_call or (len(messages) if isinstance(messages, list) else 1)

    def _record_failure(self, n: int, error) -> None:
        self.failed_requests += n
        if self.first_error is None:
            self.first_error = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        log.warning("request failed after %d attempts (%s); scored as wrong", self.attempts, error)

    def _failure_response(self, n: int) -> dict:
        raise NotImplementedError

    def model_call(self, messages, *, generate=True, gen_kwargs=None, **kwargs):
        error = None
        for attempt in range(self.attempts):
            try:
                result = super().model_call(messages, generate=generate, gen_kwargs=gen_kwargs, **kwargs)
                return _checked(result, self._prompts(messages)) if generate else result
            except Exception as e:  # noqa: BLE001 - any transport or HTTP error is retried, then recorded
                error = e
                if attempt + 1 < self.attempts:
                    time.sleep(min(10.0, 2.0 ** attempt))
        if not generate:
            raise error
        n = self._prompts(messages)
        self._record_failure(n, error)
        return self._failure_response(n)

    async def amodel_call(self, session, sem, messages, *, generate=True, cache_keys=None, ctxlens=None,
                          gen_kwargs=None, **kwargs):
        error = None
        for attempt in range(self.attempts):
            try:
                result = await super().amodel_call(session, sem, messages, generate=generate,
                                                   cache_keys=cache_keys, ctxlens=ctxlens, gen_kwargs=gen_kwargs,
                                                   **kwargs)
                return _checked(result, self._prompts(messages)) if generate else result
            except Exception as e:  # noqa: BLE001 - as in model_call
                error = e
                if attempt + 1 < self.attempts:
                    await asyncio.sleep(min(10.0, 2.0 ** attempt))
        if not generate:
            raise error
        n = self._prompts(messages)
        self._record_failure(n, error)
        return [FAILED_GENERATION] * n


def _api_classes():
    from lm_eval.models.openai_completions import LocalChatCompletion, LocalCompletionsAPI

    class RetryingCompletions(_RetryingCalls, LocalCompletionsAPI):
        def _failure_response(self, n):
            return {"choices": [{"index": i, "text": FAILED_GENERATION} for i in range(n)]}

    class RetryingChat(_RetryingCalls, LocalChatCompletion):
        prompts_per_call = 1

        def _failure_response(self, n):
            return {"choices": [{"index": 0, "message": {"content": FAILED_GENERATION}}]}

    return {"completions": RetryingCompletions, "chat": RetryingChat}


def _server_backend(source: str, label: str, options: BackendOptions) -> Backend:
    url = endpoint_url(source, options.endpoint)
    model = options.server_model or served_model_name(url)
    cls = _api_classes()[options.endpoint]
    # The server tokenizes (tokenizer_backend=None, tokenized_requests=False): no local tokenizer is needed,
    # no BOS is dropped and no context is silently left-truncated (lm-evaluation-harness
    # lm_eval/models/api_models.py, TemplateAPI).
    lm = cls(model=model, base_url=url, tokenizer_backend=None, tokenized_requests=False,
             num_concurrent=options.concurrency, max_retries=1, timeout=options.timeout,
             max_gen_toks=options.max_gen_toks)
    lm.attempts = max(1, options.max_retries)
    return Backend(label=label, source=source, kind="server", lm=lm, chat=options.endpoint == "chat",
                   activations="server", description=f"server {url} (model {model!r}, {options.endpoint} endpoint)")


# ----------------------------------------------------------------------------------------- in process


def describe_weights(ckpt) -> str:
    """How the checkpoint stores its Linear weights, e.g. "MXFP4 24, FP8 12, BF16 40 weight tensors"."""
    formats = Counter()
    for name, info in ckpt.tensors.items():
        if not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        if info.dtype == "U8" and f"{module}.weight_scale" in ckpt.tensors:
            formats["MXFP4"] += 1
        elif info.dtype.startswith("F8"):
            formats["FP8 block" if f"{module}.weight_scale_inv" in ckpt.tensors else "FP8"] += 1
        else:
            formats[info.dtype] += 1
    return ", ".join(f"{fmt} {n}" for fmt, n in formats.most_common()) + " weight tensors"


def _torch_device(device: str | None) -> str:
    import torch

    if device:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _causal_lm(load_dir: Path, dtype):
    """transformers' causal LM for the checkpoint; a vision-language wrapper AutoModelForCausalLM has no class for
    (Kimi-K2.5, MiniMax-M3) is loaded as its image-text-to-text model, which generates from text alone and maps
    the release's tensor names itself."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    from quant.model_exec.mtp import experts_options

    usable_cpu_attention()
    config = AutoConfig.from_pretrained(load_dir)
    options = experts_options(dtype)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return AutoModelForImageTextToText.from_pretrained(load_dir, dtype=dtype, **options)
    return AutoModelForCausalLM.from_pretrained(load_dir, dtype=dtype, **options)


def load_checkpoint_model(path: Path, work_dir: Path, *, dtype: str = "bfloat16", device: str | None = None,
                          with_draft: bool = False, activations: str | None = None):
    """(model, tokenizer, description, notes[, draft]) for a checkpoint directory; a quantized one is dequantized
    into `work_dir` first (deleted again once loaded). With `with_draft`, also the checkpoint's MTP draft
    (evals.arms.mtp_draft; None when it has no MTP layers), read from the same (dequantized) tensors.
    `activations`: "emulate" quantize-dequantizes each quantized linear's input as the scheme says, "bf16" leaves
    it; None: emulate where the scheme quantizes activations. The mode that ran is `model.quant_activations`."""
    import torch
    from transformers import AutoTokenizer

    from quant.checkpoint import open_checkpoint

    _check_choices(dtype, activations)
    ckpt = open_checkpoint(path)
    weights = describe_weights(ckpt)
    quantized = "quantization_config" in ckpt.config
    load_dir = Path(path)
    notes = []
    formats = {}
    if quantized:
        from quant.dequant import activation_formats, dequantize_checkpoint

        if activations != "bf16":
            formats = activation_formats(ckpt)  # a scheme emulate cannot model is refused before any work
        load_dir = Path(work_dir) / f"dequantized-{Path(path).name}"
        shutil.rmtree(load_dir, ignore_errors=True)
        dequantize_checkpoint(path, load_dir)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    # transformers lists every MTP-layer tensor as UNEXPECTED (it never builds the MTP layer): expected, not news.
    hf_logging.set_verbosity_error()
    try:
        model = _causal_lm(load_dir, getattr(torch, dtype))
        tokenizer = AutoTokenizer.from_pretrained(load_dir)
        draft = None
        if with_draft:
            from evals.arms.mtp_draft import load_draft

            draft = load_draft(load_dir, dtype=getattr(torch, dtype), device=_torch_device(device))
    except (OSError, ValueError) as e:
        raise QuantError(f"{path}: transformers cannot load the checkpoint ({e})") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if quantized:
            shutil.rmtree(load_dir, ignore_errors=True)
    device = _torch_device(device)
    model = model.to(device).eval()
    mode = _emulate_activations(model, ckpt, formats, with_draft, notes) if formats else "bf16"
    if quantized and mode == "bf16":
        why = "--activations bf16" if activations == "bf16" else "the scheme quantizes weights only"
        notes.append(f"weights-only emulation: quantized weights dequantized into BF16, activations not quantized "
                     f"({why})")
    model.quant_activations = mode
    description = f"transformers on {device} ({weights}{', dequantized to ' + dtype if quantized else ''}" \
                  f"{', activations ' + ('emulated' if mode == 'emulate' else 'BF16') if quantized else ''})"
    if with_draft:
        return model, tokenizer, description, notes, draft
    return model, tokenizer, description, notes


def _check_choices(dtype: str, activations: str | None) -> None:
    if dtype not in DTYPES:
        raise QuantError(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    if activations is not None and activations not in ACTIVATIONS:
        raise QuantError(f"--activations {activations!r}: choose from {', '.join(ACTIVATIONS)}")


def _emulate_activations(model, ckpt, formats: dict, with_draft: bool, notes: list[str]) -> str:
    """Hook each quantized linear of `model` to quantize-dequantize its input as the scheme says; the mode that
    runs ("emulate", or "bf16" when no module was hooked), its note appended to `notes`."""
    from quant.dequant import emulate_activations

    layers = (ckpt.config.get("text_config") or ckpt.config).get("num_hidden_layers")
    family = family_for_config(ckpt.config, ckpt.root / "config.json")
    hooked = emulate_activations(model, formats, layers, family.transformers_layer)
    if not hooked:
        return "bf16"
    notes.append("activations emulated: each quantized linear's input quantize-dequantized as the scheme says ("
                 + ", ".join(f"{label} on {n}" for label, n in sorted(hooked.items())) + " modules)"
                 + ("; the MTP draft's layers run BF16 activations" if with_draft else ""))
    return "emulate"


def _transformers_backend(path: Path, label: str, options: BackendOptions, work_dir: Path) -> Backend:
    from lm_eval.models.huggingface import HFLM

    loaded = load_checkpoint_model(path, work_dir / label, dtype=options.dtype, device=options.device,
                                   with_draft=options.mtp, activations=options.activations)
    model, tokenizer, description, notes = loaded[:4]
    draft = loaded[4] if options.mtp else None
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=options.batch_size)
    note = "" if draft is not None else ("MTP not measured (--mtp off)" if not options.mtp
                                         else "the checkpoint has no MTP layers")
    return Backend(label=label, source=str(path), kind="transformers", lm=lm, description=description,
                   notes=notes, draft=draft, draft_note=note, activations=model.quant_activations)
