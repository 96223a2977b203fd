"""The reference runtime (``specattn.spec_runtime``): speculative decoding end to end.

- :mod:`.engine`: the step loop (none, EAGLE chain/tree, DFlash) over any attention backend;
- :mod:`.model`, :mod:`.mla_model`: Llama and DeepSeek-style MLA decoders;
- :mod:`.loader`, :mod:`.model_fetch`: GGUF / HF checkpoints, tokenizer, HF oracle;
- :mod:`.graph_runner`: CUDA-graph capture/replay; :mod:`.dflash`: the block drafter;
- :mod:`.cli`: ``specattn generate`` and ``specattn model fetch``.
"""
