"""Real weights: checkpoint layout, lazy selective reads, pruned renaming, quantized formats,
manifests (docs/weights.md). The streamed float64 reference built on them is
``harness.precision.stream``.

One module per concern:

* ``layout``    the checkpoint directory: shards, index, headers, pickle refusal;
* ``reader``    lazy reads with safetensors' ``safe_open`` / ``get_slice``, counting bytes;
* ``rename``    which layers/experts a pruned model keeps and the key of every tensor it reads;
* ``quant``     FP8 block, INT4 pack-quantized, MXFP4: exact float64 dequantization;
* ``load``      fill a pruned model (what ``build_model`` calls);
* ``manifest``  shard checksums, recorded and verified;
* ``expected``  what the full model expects in the checkpoint (meta device), for the load check;
* ``place``     the full-size model built straight onto its devices (the streamed reference's target);
* ``native``    the backend's own FP8 / INT4 kernels in place of dequantized Linear layers;
* ``source``    where the suite's weights are, or why there are none.
"""

from __future__ import annotations

from harness.weights.layout import Checkpoint, WeightsError, open_checkpoint
from harness.weights.load import load_pruned, provenance, weights_provenance

__all__ = ["Checkpoint", "WeightsError", "load_pruned", "open_checkpoint", "provenance", "weights_provenance"]
