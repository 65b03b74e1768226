"""`python -m slime_async.buffer SETTINGS_JSON`: run a buffer server process (see `server.main`)."""

from slime_async.buffer.server import main

main()
