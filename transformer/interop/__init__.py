"""Models in and out: the Hugging Face Marian format (`marian`) and CTranslate2 (`ctranslate2`).

`convert.py` is the command; `marian` maps parameters exactly (numpy and safetensors only),
`hf_files` writes and reads a Hugging Face directory (weights, config, tokenizer files),
`ctranslate2` builds a CTranslate2 model from the same arrays.
"""
