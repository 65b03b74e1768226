"""Weight wire: the format in which the trainer's weights reach an engine over HTTP.

Owns: the `serialized_named_tensors` items of `/update_weights_from_tensor` (`codec`: safetensors
bytes in base64, encoded and decoded with a named error per bad item) and SGLang's own format of
tensor handles (`shared_tensors`: CUDA IPC, or shared-memory files for CPU tensors; unpickled only
through checked rebuild functions).

Both sides import it: `sync` (the publisher) encodes, `engine` decodes; neither imports the other.
Does not own: when weights are pushed or to whom (`sync`), copying them into a served model (`engine`).
"""
