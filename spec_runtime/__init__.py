"""The reference runtime (``specattn.spec_runtime``): speculative decoding end to end.

- :mod:`.engine`: pools, backends, device state, whole-round CUDA graphs and the host loop;
- :mod:`.strategies`: the algorithms (``none``, ``eagle``) as strategies over the engine;
  :mod:`.dflash`: the DFlash block drafter and its strategy;
- :mod:`.model`, :mod:`.mla_model`: Llama (fused on GPUs) and DeepSeek-style MLA decoders;
- :mod:`.eagle3`, :mod:`.train_drafter`: the EAGLE-3 drafter and ``specattn drafter train``;
- :mod:`.loader`, :mod:`.model_fetch`: GGUF / HF checkpoints, tokenizer, HF oracle;
- :mod:`.graph_runner`: per-mode CUDA graphs for host-planned backends;
- :mod:`.cli`, :mod:`.drafter_cli`: ``specattn generate``, ``specattn model fetch``,
  ``specattn drafter train``.
"""
