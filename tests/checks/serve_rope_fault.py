"""A positional fault in the serving engine's own process (tests/checks/test_serve.py): run there by the
vLLM runner (``preload``) before vLLM builds the model, it makes vLLM's rotary embedding rotate every
position p >= 4 as p + 3. Positions 0-3 stay exact; from position 4 on, a query's distance to the
keys before position 4 is off by 3 - the shape of a decode/positional bug in an engine kernel.
Imports vLLM and torch only: the engine's venv has no harness."""

import torch
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

FROM, SHIFT = 4, 3


def _wrong(fn):
    def forward(self, positions, query, key=None):
        return fn(self, torch.where(positions >= FROM, positions + SHIFT, positions), query, key)

    return forward


# both: vLLM dispatches to forward_cpu or forward_native (custom op enabled or not) at construction
for _name in ("forward_native", "forward_cpu"):
    setattr(RotaryEmbedding, _name, _wrong(getattr(RotaryEmbedding, _name)))
