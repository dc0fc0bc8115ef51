"""A Hugging Face causal LM behind verl's async rollout server interface, so verl's own agent loops
(``ToolAgentLoop``) run on CPU: ``await server.generate(request_id, prompt_ids=..., sampling_params=...)``
returns verl's ``TokenOutput`` (response token ids and their log-probabilities under the model).
"""

from __future__ import annotations

import asyncio
import threading


class HFAsyncServer:
    """:param script: optional list of responses (token id lists) returned in order before the model samples;
    their log-probabilities are still the model's (teacher forcing), so a policy loss on them is a real one.
    :param eos_ids: stop tokens (default the tokenizer's EOS); the trainer passes the generation config's too.
    :param with_log_probs: off in the trainer, which recomputes old log-probabilities itself.
    """

    def __init__(
        self,
        model,
        tokenizer,
        max_new_tokens: int = 16,
        script: list[list[int]] | None = None,
        eos_ids: list[int] | None = None,
        with_log_probs: bool = True,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.script = list(script or [])
        self.eos_ids = list(eos_ids or [tokenizer.eos_token_id])
        self.with_log_probs = with_log_probs
        self.calls: list[dict] = []
        # Trajectories run concurrently (tools overlap), but one forward pass at a time: the model is not thread-safe
        # (FSDP hooks, generate's caches) and two at once would not be faster on the same cores.
        self._model_lock = threading.Lock()

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **_multimodal):
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids)})
        # One model at a time: generate and the log-prob pass run in a thread so the event loop (tools) goes on.
        if self.script:
            response = list(self.script.pop(0))
        else:
            response = await asyncio.to_thread(self._sample, list(prompt_ids), dict(sampling_params))
        log_probs = await asyncio.to_thread(self.log_probs, list(prompt_ids), response) if self.with_log_probs else None
        return TokenOutput(token_ids=response, log_probs=log_probs, stop_reason="completed")

    def _sample(self, prompt_ids: list[int], sp: dict) -> list[int]:
        import torch

        temperature = float(sp.get("temperature", 1.0))
        eos = [*self.eos_ids, *(sp.get("stop_token_ids") or [])]
        top_k = int(sp.get("top_k") or 0)
        sampling = dict(do_sample=True, temperature=temperature, top_p=float(sp.get("top_p", 1.0)))
        sampling["top_k"] = top_k if top_k > 0 else 0  # verl's -1 means none
        # As vLLM samples in verl's rollouts: no repetition penalty whatever generation_config says, EOS allowed at once
        with self._model_lock, torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=int(sp.get("max_tokens") or sp.get("max_new_tokens") or self.max_new_tokens),
                **(sampling if temperature > 0 else dict(do_sample=False, temperature=None, top_p=None, top_k=None)),
                eos_token_id=eos,
                pad_token_id=self.tokenizer.pad_token_id,
                repetition_penalty=1.0,
                no_repeat_ngram_size=0,
                min_new_tokens=0,
            )
        return out[0, len(prompt_ids) :].tolist()

    def log_probs(self, prompt_ids: list[int], response: list[int]) -> list[float]:
        import torch

        with self._model_lock, torch.no_grad():
            logits = self.model(torch.tensor([prompt_ids + response])).logits[0, len(prompt_ids) - 1 : -1]
            return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()
