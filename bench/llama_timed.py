#!/usr/bin/env python3
"""llama-cpp-python's server (`python -m llama_cpp.server`, same arguments) that prints when each
step of its start ends, for bench/real-server.sh's cold-start split. On stderr (the Slurm job's
log), one line each: `gpuhub-bench: at_us=UNIX_MICROSECONDS EVENT` for `python started`,
`imported`, `model load start`, `model loaded` (llama_cpp.Llama.__init__ returned) and
`listening` (uvicorn bound its socket). Everything else is the stock server.
"""
import sys
import time


def mark(event: str) -> None:
    sys.stderr.write(f"gpuhub-bench: at_us={time.time_ns() // 1000} {event}\n")
    sys.stderr.flush()


mark("python started")
import llama_cpp  # noqa: E402
import llama_cpp.server.__main__ as server  # noqa: E402
import uvicorn  # noqa: E402

mark("imported")
_init = llama_cpp.Llama.__init__


def _timed_init(self, *args, **kwargs):
    mark("model load start")
    _init(self, *args, **kwargs)
    mark("model loaded")


llama_cpp.Llama.__init__ = _timed_init
_startup = uvicorn.Server.startup


async def _timed_startup(self, *args, **kwargs):
    await _startup(self, *args, **kwargs)
    mark("listening")


uvicorn.Server.startup = _timed_startup
sys.argv[0] = "llama_cpp.server"
server.main()
