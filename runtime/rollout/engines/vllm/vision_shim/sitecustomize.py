"""Lets vLLM load a Qwen2-VL-family model where torchvision is not installed (the CPU venvs:
PyPI's torchvision wheels are CUDA builds). Put on ``PYTHONPATH`` by the vLLM engine for a
vision-language model (rollout/engines/vllm/vision.py), so that it runs in every process vLLM
starts (its model-registry inspection runs in a subprocess). With torchvision installed it does
nothing. Three pieces, each for one import or call that needs torchvision (docs/vlm.md):

- transformers' ``image_processing_qwen2_vl`` imports torchvision at module level; vLLM's
  qwen2_vl imports ``smart_resize`` from it: the module is aliased to the PIL image processor's
  module (``image_processing_pil_qwen2_vl``), which defines the same ``smart_resize``;
- ``Qwen2VLProcessor.from_pretrained`` loads a video processor (torchvision): it is left out of
  the processor's sub-processors;
- vLLM reads ``processor.video_processor.valid_kwargs``: a stand-in without kwargs is given,
  which refuses to process a video.
"""
import importlib.util
import sys

if importlib.util.find_spec("torchvision") is None and importlib.util.find_spec("transformers") is not None:
    try:
        import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as _pil
        from transformers.models.qwen2_vl import processing_qwen2_vl as _processing
    except ImportError:  # a transformers without them: nothing to do
        pass
    else:
        sys.modules.setdefault("transformers.models.qwen2_vl.image_processing_qwen2_vl", _pil)
        _attributes = _processing.Qwen2VLProcessor.get_attributes.__func__

        def _without_video(cls):
            return [a for a in _attributes(cls) if a != "video_processor"]

        class _NoVideoProcessor:
            """Stands in for the torchvision video processor: videos are not supported."""

            class valid_kwargs:  # noqa: N801 (vLLM reads its annotations)
                __annotations__ = {}

            def __call__(self, *args, **kwargs):
                raise RuntimeError("videos need torchvision, which is not installed here")

        _processing.Qwen2VLProcessor.get_attributes = classmethod(_without_video)
        _processing.Qwen2VLProcessor.video_processor = _NoVideoProcessor()
