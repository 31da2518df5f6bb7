"""jaxinfer: LLM inference on JAX/XLA.

    import jaxinfer as ji
    llm = ji.LLM("smollm2-135m")
    print(llm.generate("The capital of France is")[0].text)
"""

from jaxinfer.config import MeshConfig, SpeculativeConfig
from jaxinfer.device.loop import decode_loop
from jaxinfer.device.state import DecodeState, RowParams, admit_rows
from jaxinfer.device.step import StepOutput, step
from jaxinfer.device.token_batch import TokenBatch
from jaxinfer.engine.request import RequestMetrics, RequestOutput, SamplingParams
from jaxinfer.llm import LLM, EncodedPrompt
from jaxinfer.structured import StructuredOutputs

__all__ = ["LLM", "EncodedPrompt", "MeshConfig", "RequestMetrics", "RequestOutput",
           "SamplingParams", "SpeculativeConfig", "StructuredOutputs", "step", "decode_loop",
           "admit_rows", "DecodeState", "RowParams", "StepOutput", "TokenBatch"]
__version__ = "0.1.0"
