"""A stand-in for SGLang in tests of the launch path (SGLang needs a GPU stack): see launch_server."""
