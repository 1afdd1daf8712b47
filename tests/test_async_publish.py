"""AsyncEngine hands a step's outputs to the event loop in one call: a failure while they are
being built (here the observer) still delivers what was built, and every other stream ends with
the error; no client waits forever."""
from __future__ import annotations

import asyncio

import pytest

from flash_dllm.config import SamplingParams
from flash_dllm.engine.async_engine import AsyncEngine, EngineUnavailableError
from flash_dllm.engine.engine import Engine
from test_paged_engine import LONG
from test_sampler import tiny


class FailsAfterAFinish:
    """A metrics observer that raises in the step where a request finished (after its
    ``on_finish``, when that step's outputs are being built)."""

    def __init__(self) -> None:
        self.finished = False

    def on_step(self, seconds, batch_size):
        pass

    def on_first_token(self, seconds):
        pass

    def on_finish(self, output, seconds):
        self.finished = True

    def on_tokens(self, n):
        if self.finished:
            raise RuntimeError("observer broke")


async def _collect(stream):
    outs = []
    try:
        async for out in stream:
            outs.append(out)
    except EngineUnavailableError as e:
        return outs, e
    return outs, None


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the engine
def test_a_failure_while_publishing_still_ends_every_stream():   # thread dies, as it should)
    model = tiny("llada", seed=3)
    aeng = AsyncEngine(Engine(model, model.cfg), observer=FailsAfterAFinish())

    async def main():
        short = aeng.submit(LONG[0], SamplingParams(max_tokens=8, block_length=8,
                                                    decode="threshold", threshold=0.05,
                                                    cache="none"))
        long = aeng.submit(LONG[1], SamplingParams(max_tokens=64, block_length=8,
                                                   decode="vanilla", cache="none"))
        return await asyncio.wait_for(asyncio.gather(_collect(short), _collect(long)), 30)

    (short_outs, short_err), (long_outs, long_err) = asyncio.run(main())
    aeng._thread.join(10)        # (its exception is reported while this test still runs)
    # the request that finished in the failing step got its final output (built before the
    # failure), the other one the engine's error
    assert short_err is None and short_outs[-1].finished
    assert isinstance(long_err, EngineUnavailableError) and "observer broke" in str(long_err)
    assert not aeng.alive
