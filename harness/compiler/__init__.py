"""The compiled path: ``torch.compile`` of a model with a backend's compiler, and what dynamo says
about it (the ``compile`` check's library; docs/compile.md).

* ``dynamo``  which compiler a backend has (or why none is usable), compiling, graph breaks with
  their reasons and user frames, recompiles across shapes with dynamo's guard-failure reasons;
* ``bisect``  the smallest region whose compiled version alone diverges from eager: decoder layers,
  then their submodules, each compiled on its own while the rest of the model runs eagerly;
* ``numerics``  compiled logits against the golden and eager, the LM loss bound, MoE routing forced
  to the golden's choices;
* ``sweep``  the recompile sweep over prompt lengths and a decode step, with its backend fallbacks;
* ``gradients``  the compiled backward's parameter gradients against the golden's training section;
* ``bounds``, ``counts``, ``backward``  the compile check's numerics, breaks / recompiles and
  gradients steps as library calls (the bounds logits are held to; counts against the committed ones).
"""
