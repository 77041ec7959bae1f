"""Lets vLLM load a Qwen2-VL-family model where torchvision is not installed (the CPU venvs:
PyPI's torchvision wheels are CUDA builds). Put on ``PYTHONPATH`` by the vLLM engine for a
vision-language model (rollout/engines/vllm/vision.py), so that it runs in every process vLLM
starts (its model-registry inspection runs in a subprocess). With torchvision installed it does
nothing. Three pieces, each for one import or call that needs torchvision (docs/vlm.md):

- transformers' ``image_processing_qwen2_vl`` imports torchvision at module level; vLLM's
  qwen2_vl imports ``smart_resize`` from it: the module is aliased to the PIL image processor's
  module (``image_processing_pil_qwen2_vl``), which defines the same ``smart_resize``;
- ``Qwen2VLProcessor.from_pretrained`` (and Qwen2.5-VL's and Qwen3-VL's processors') loads a
  video processor (torchvision): it is left out of the processor's sub-processors;
- vLLM reads ``processor.video_processor.valid_kwargs`` (and, for Qwen3-VL, its geometry to
  size the multimodal budget): a stand-in without kwargs, with the image processor's geometry,
  is given, which refuses to process a video.
"""
import importlib
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

        # Qwen2-VL's processor, and Qwen2.5-VL's and Qwen3-VL's, which are not its subclasses
        _classes = [_processing.Qwen2VLProcessor]
        for _module, _name in (("transformers.models.qwen2_5_vl.processing_qwen2_5_vl", "Qwen2_5_VLProcessor"),
                               ("transformers.models.qwen3_vl.processing_qwen3_vl", "Qwen3VLProcessor")):
            try:
                _classes.append(getattr(importlib.import_module(_module), _name))
            except (ImportError, AttributeError):
                pass
        def _stand_in(self):
            # vLLM sizes its multimodal budget from the video processor's geometry (Qwen3-VL's
            # reads size, patch and merge sizes even when videos are off): the image processor's
            out = _NoVideoProcessor()
            image = getattr(self, "image_processor", None)
            for name in ("size", "patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
                if hasattr(image, name):
                    setattr(out, name, getattr(image, name))
            return out

        for _cls in _classes:
            _cls.get_attributes = classmethod(_without_video)
            _cls.video_processor = property(_stand_in)
