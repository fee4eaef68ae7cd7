"""Chat-style text generation with a transformers causal LM: the CPU (and small-GPU) engine.

The same logged model runs on vLLM through ``ray.data.llm`` when a job has GPUs
(``runtime/model/llm.py``); this flavor is what runs everywhere else, so a summarization DAG works on a
laptop and in CI. Each row is generated on its own: outputs then never depend on which rows share
a batch (no padding effects), and a row's ``seed`` reproduces it exactly. Token counts are the
tokenizer's real counts: the chat-templated prompt and every generated token (EOS included).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from airflow_provider_batchinfer.contract.chat import finish_reason, response, response_columns, sampling_params
from airflow_provider_batchinfer.runtime.model.dereference import MESSAGES_DTYPE, parse_messages
from airflow_provider_batchinfer.runtime.model.flavors.protocol import Flavor


def text_only(messages: list[dict[str, Any]], column: str, model: str) -> list[dict[str, Any]]:
    """A text model's chat template takes strings: join text parts, refuse images and audio clearly."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            kinds = sorted({p.get("type", "?") for p in content} - {"text"})
            if kinds:
                raise ValueError(
                    f"column {column!r}: model {model} reads text only, but a message has {kinds} parts; use a "
                    "multimodal model on the vLLM engine (JobSpec(engine='vllm')) or drop those parts"
                )
            content = "\n".join(p.get("text", "") for p in content)
        out.append({**m, "content": content})
    return out


def load(model_dir: Path, manifest: dict[str, Any], device: str, threads: int, max_rows: int | None = None):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

    class _StopOnText(StoppingCriteria):
        """Stop once the generated text holds a stop string. transformers' own ``stop_strings``
        needs tokenizers whose pieces decode with a static prefix (BPE, SentencePiece) and fails on
        others (word-level), so this decodes and looks, which works with every tokenizer."""

        def __init__(self, tok: Any, prompt_len: int, stops: list[str]) -> None:
            self.tok, self.prompt_len, self.stops = tok, prompt_len, stops

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            done = [
                any(s in self.tok.decode(row[self.prompt_len :], skip_special_tokens=True) for s in self.stops)
                for row in input_ids
            ]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    path = str(model_dir / manifest["options"]["dir"])
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device).eval()
    name = f"{manifest['name']}/{manifest['version']}"
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {name}: its tokenizer has no chat template; log a chat/instruct model")
    inputs_sig = manifest["signature"]["inputs"]
    (message_col,) = [c for c, t in inputs_sig.items() if t == MESSAGES_DTYPE] or ["messages"]
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids), 0)

    def generate_one(messages: list[dict[str, Any]], sp: dict[str, Any]) -> dict[str, Any]:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = torch.tensor([list(prompt)], device=device)
        kwargs: dict[str, Any] = {
            "max_new_tokens": sp["max_tokens"],
            "pad_token_id": pad,
            "attention_mask": torch.ones_like(ids),
        }
        if float(sp["temperature"]) > 0:
            kwargs.update(do_sample=True, temperature=float(sp["temperature"]), top_p=float(sp["top_p"]))
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if sp["stop"]:
            kwargs["stopping_criteria"] = StoppingCriteriaList([_StopOnText(tokenizer, ids.shape[1], sp["stop"])])
        if sp["seed"] is not None:
            torch.manual_seed(int(sp["seed"]))
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
        generated = out[0, ids.shape[1] :].tolist()
        text = tokenizer.decode(generated, skip_special_tokens=True)
        stopped = bool(generated) and generated[-1] in eos_ids
        for stop in sp["stop"] or ():
            cut = text.find(stop)
            if cut >= 0:  # OpenAI leaves the stop sequence out of the content
                text, stopped = text[:cut], True
        reason = finish_reason(len(generated), sp["max_tokens"], stopped)
        return response(text.strip(), reason, len(prompt), len(generated))

    def predict(inputs, params: dict[str, Any]) -> dict[str, Any]:
        rows = inputs.column(message_col).to_pylist()
        overrides = (
            inputs.column("sampling_params").to_pylist()
            if "sampling_params" in inputs.column_names
            else [None] * len(rows)
        )
        results = []
        for value, override in zip(rows, overrides, strict=False):
            messages = text_only(parse_messages(value, message_col), message_col, name)
            results.append(generate_one(messages, sampling_params(params, override)))
        return response_columns(results)

    return predict


# transfer_rows 0: generation dominates; Ray's batches are already as large as a model call
# (JobSpec.max_batch_rows, unset: Tuning.call_rows)
FLAVOR = Flavor(name="text_generation", load=load, transfer_rows=0)
