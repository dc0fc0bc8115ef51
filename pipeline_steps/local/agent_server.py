"""A Hugging Face causal LM behind verl's async rollout server interface, so verl's own agent loops
(``ToolAgentLoop``) run on CPU: ``await server.generate(request_id, prompt_ids=..., sampling_params=...)``
returns verl's ``TokenOutput`` (response token ids and their log-probabilities under the model).
"""

from __future__ import annotations

import asyncio


class HFAsyncServer:
    """:param script: optional list of responses (token id lists) returned in order before the model samples;
    their log-probabilities are still the model's (teacher forcing), so a policy loss on them is a real one.
    """

    def __init__(self, model, tokenizer, max_new_tokens: int = 16, script: list[list[int]] | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.script = list(script or [])
        self.calls: list[dict] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict, **_multimodal):
        from verl.workers.rollout.replica import TokenOutput

        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids)})
        # One model at a time: generate and the log-prob pass run in a thread so the event loop (tools) goes on.
        if self.script:
            response = list(self.script.pop(0))
        else:
            response = await asyncio.to_thread(self._sample, list(prompt_ids), dict(sampling_params))
        log_probs = await asyncio.to_thread(self.log_probs, list(prompt_ids), response)
        return TokenOutput(token_ids=response, log_probs=log_probs, stop_reason="completed")

    def _sample(self, prompt_ids: list[int], sp: dict) -> list[int]:
        import torch

        temperature = float(sp.get("temperature", 1.0))
        eos = [self.tokenizer.eos_token_id, *(sp.get("stop_token_ids") or [])]
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                max_new_tokens=int(sp.get("max_tokens") or sp.get("max_new_tokens") or self.max_new_tokens),
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=float(sp.get("top_p", 1.0)),
                eos_token_id=eos,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        return out[0, len(prompt_ids) :].tolist()

    def log_probs(self, prompt_ids: list[int], response: list[int]) -> list[float]:
        import torch

        with torch.no_grad():
            logits = self.model(torch.tensor([prompt_ids + response])).logits[0, len(prompt_ids) - 1 : -1]
            return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()
