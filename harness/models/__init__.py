"""Models: from a suite's config.json to a seeded ``torch.nn.Module``.

* ``config``    config.json -> transformers config: Day-0 fallbacks, architecture resolution, pruning;
* ``prune``     the pruning ``harness init`` derives from a config (every per-layer field, one layer of each kind);
* ``builders``  model builders by name (``harness.models`` entry points; ``hf`` is transformers' class);
* ``loaders``   real-weight loaders (``harness.weights`` entry points; ``safetensors`` is harness.weights.load);
* ``build``     instantiate, cast as a deployed model is, the seeded (or real-weight) build;
* ``numerics``  realistic gains for random weights (peaky attention, a growing residual stream);
* ``wrapper``   multimodal wrappers end to end: a tiny vision tower and a synthetic image;
* ``probe``     a built model through forward, backward, optimizer steps and generation, and where it
  goes wrong (the smoke check's steps)."""
