"""jaxinfer: LLM inference on JAX/XLA.

    import jaxinfer as ji
    llm = ji.LLM("smollm2-135m")
    print(llm.generate("The capital of France is")[0].text)
"""

from jaxinfer import tuning as _tuning

# Before anything can start a backend: XLA reads XLA_FLAGS once, when the first one starts.
_tuning.set_cpu_xla_flags()

from jaxinfer.config import MeshConfig  # noqa: E402
from jaxinfer.decode import DecodeState, RowParams, StepOutput, admit_rows, step  # noqa: E402
from jaxinfer.engine.request import RequestMetrics, RequestOutput, SamplingParams  # noqa: E402
from jaxinfer.llm import LLM, EncodedPrompt  # noqa: E402
from jaxinfer.speculative import SpeculativeConfig  # noqa: E402
from jaxinfer.token_batch import TokenBatch  # noqa: E402

__all__ = ["LLM", "EncodedPrompt", "MeshConfig", "RequestMetrics", "RequestOutput", "SamplingParams",
           "SpeculativeConfig", "step", "admit_rows", "DecodeState", "RowParams", "StepOutput",
           "TokenBatch"]
__version__ = "0.1.0"
