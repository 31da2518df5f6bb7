"""jaxinfer: LLM inference on JAX/XLA.

    import jaxinfer as ji
    llm = ji.LLM("smollm2-135m")
    print(llm.generate("The capital of France is")[0].text)
"""

from jaxinfer.config import MeshConfig
from jaxinfer.engine.request import RequestMetrics, RequestOutput, SamplingParams
from jaxinfer.llm import LLM
from jaxinfer.speculative import SpeculativeConfig

__all__ = ["LLM", "MeshConfig", "RequestMetrics", "RequestOutput", "SamplingParams",
           "SpeculativeConfig"]
__version__ = "0.1.0"
