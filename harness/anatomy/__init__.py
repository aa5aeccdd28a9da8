"""Model anatomy: the one place that knows a transformers model's structure, so that every check,
capture and parallel layout asks here instead of keeping its own copy.

* ``layers``: the decoder-layer stack and each layer's attention;
* ``moe``: expert and top-k counts, routers, routed experts, what kind a module is;
* ``quant``: a checkpoint's quantization scheme (``quantization_config``);
* ``capture``: forward hooks that record module outputs (and inputs, for replay), router choices
  and rotary tables; the goldens, the precision comparison, the parallel check and the streamed
  reference are built on it.

It depends on torch and transformers only (layer: docs/architecture.md).
"""
