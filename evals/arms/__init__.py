"""The two arms of an eval: running one model over the tasks and keeping every answer.

`tasks` (the offline lm-eval task files), `hub_data` (GSM8K / GPQA from the hub), `backends` (in-process
transformers or an OpenAI-compatible server), `lm_eval_run` (driving lm-eval), `model_server` (the project's own
test server), `server_metrics` (draft acceptance read from a server), `mtp_draft` and `mtp_measure` (the in-process
MTP draft and its acceptance), `nll` (held-out log-likelihood)."""
