"""jaxinfer: LLM inference on JAX/XLA.

    import jaxinfer as ji
    llm = ji.LLM("smollm2-135m")
    print(llm.generate("The capital of France is")[0].text)
"""

from jaxinfer.config import MeshConfig
from jaxinfer.decode import DecodeState, RowParams, StepOutput, admit_rows, step
from jaxinfer.engine.request import RequestMetrics, RequestOutput, SamplingParams
from jaxinfer.llm import LLM, EncodedPrompt
from jaxinfer.speculative import SpeculativeConfig
from jaxinfer.token_batch import TokenBatch

__all__ = ["LLM", "EncodedPrompt", "MeshConfig", "RequestMetrics", "RequestOutput", "SamplingParams",
           "SpeculativeConfig", "step", "admit_rows", "DecodeState", "RowParams", "StepOutput",
           "TokenBatch"]
__version__ = "0.1.0"
