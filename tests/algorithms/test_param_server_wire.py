"""The parameter server's wire format: every model's parts survive a message, whatever their
counts (zero, odd) and dtypes.

The old frame put an int64 section right after 4 x (parameters + float buffers) bytes, so a model
with an odd number of float32 values could not be sent at all (``storage_offset() must be
divisible by 8``). Here a message's bytes are written, copied into a second frame as the socket
would, and read back: every value must come back bit for bit, in its own dtype."""

from __future__ import annotations

import struct

import pytest
import torch
from torch import nn

from distsgd.algorithms.param_server import wire
from distsgd.algorithms.param_server.wire import ALIGN, Frame, Layout
from distsgd.errors import ConfigError

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
OTHERS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -(2**31)), min(info.max, 2**31 - 1) + 1, (n,), generator=g, dtype=torch.int64
    ).to(dtype)


sizes = st.integers(min_value=0, max_value=37)
parts = st.tuples(
    st.tuples(st.sampled_from(FLOATS), st.lists(sizes, max_size=4)),
    st.lists(st.tuples(st.sampled_from(FLOATS), sizes), max_size=5),
    st.lists(st.tuples(st.sampled_from(OTHERS), sizes), max_size=5),
)


def _through_the_wire(sent: Frame) -> Frame:
    """What the other end holds after reading the message's bytes into a frame of its own."""
    got = Frame(sent.buffer.numel() - 32)
    got.view[:] = bytes(sent.view)
    return got


@settings(max_examples=200, deadline=None)
@given(parts, st.integers(0, 2**16), st.integers(0, 9))
def test_every_part_comes_back_bit_for_bit(spec, seed: int, hypers: int) -> None:
    (param_dtype, param_sizes), floats, others = spec
    layout = Layout([(param_dtype, n) for n in param_sizes], floats, others, hypers)
    params = [_values(param_dtype, n, seed + i) for i, n in enumerate(param_sizes)]
    fbufs = [_values(d, n, seed + 100 + i) for i, (d, n) in enumerate(floats)]
    obufs = [_values(d, n, seed + 200 + i) for i, (d, n) in enumerate(others)]

    request = Frame(layout.request_bytes)
    layout.params.pack(request, params)
    layout.floats.pack(request, fbufs)
    layout.ints.pack(request, obufs)
    settings_ = _values(torch.float64, hypers, seed + 300)  # the optimiser's, after the buffers
    if hypers:
        layout.hypers.whole(request).copy_(settings_)
    present = torch.tensor([(seed + i) % 2 for i in range(len(param_sizes))], dtype=torch.uint8)
    layout.present.whole(request).copy_(present)  # which parameters have a gradient, after those
    got = _through_the_wire(request)
    assert not hypers or torch.equal(layout.hypers.whole(got), settings_)
    assert torch.equal(layout.present.whole(got), present)
    flat = layout.params.whole(got)
    expected = torch.cat(params) if params else torch.empty(0, dtype=param_dtype)
    assert flat.numel() == expected.numel() and (not params or flat.dtype == param_dtype)
    assert torch.equal(flat.to(expected.dtype), expected)
    for want, have in zip(fbufs + obufs, layout.floats.unpack(got) + layout.ints.unpack(got, clone=True)):
        assert have.dtype == want.dtype and torch.equal(have, want)

    # An answer holds the parameters and the floating-point buffers (an exchange's difference).
    answer = Frame(layout.answer_bytes)
    layout.params.whole(answer).copy_(expected)
    layout.floats.pack(answer, fbufs)
    back = _through_the_wire(answer)
    assert torch.equal(layout.params.whole(back).to(expected.dtype), expected)
    assert all(torch.equal(h, w) for h, w in zip(layout.floats.unpack(back), fbufs))

    # Sections are aligned, in order and disjoint, and the frame holds them.
    packings = (layout.params, layout.floats, layout.ints, layout.hypers, layout.present)
    sections = [s for p in packings for s in p.sections]
    for a, b in zip(sections, sections[1:]):
        assert a.offset + a.nbytes <= b.offset
    assert all(s.offset % ALIGN == 0 for s in sections)
    assert layout.request_bytes >= max((s.offset + s.nbytes for s in sections), default=0)


class OddNet(nn.Module):
    """7 x 3 + 3 + 3 + 3 = 30 parameters... plus one: an odd count, with BatchNorm's float and
    int64 buffers after them (the case that crashed every push)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(7, 3)
        self.bn = nn.BatchNorm1d(3)
        self.scale = nn.Parameter(torch.ones(1))


def test_a_model_with_an_odd_number_of_weights_and_batchnorm() -> None:
    model = OddNet()
    n = sum(p.numel() for p in model.parameters())
    assert n % 2 == 1
    layout = Layout.of(model)
    frame = Frame(layout.request_bytes)
    layout.params.pack(frame, [p.detach() for p in model.parameters()])
    floats = [b for b in model.buffers() if b.dtype.is_floating_point]
    ints = [b for b in model.buffers() if not b.dtype.is_floating_point]
    ints[0].fill_(12345)
    layout.floats.pack(frame, floats)
    layout.ints.pack(frame, ints)
    got = _through_the_wire(frame)
    assert layout.ints.unpack(got)[0].item() == 12345
    assert torch.equal(layout.params.whole(got), torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


def test_parameters_of_several_dtypes_are_refused_in_one_line() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(ConfigError, match="several dtypes"):
        Layout.of(model)


class _Recorder:
    """A stream that keeps what is sent on it (the bytes a socket would carry)."""

    def __init__(self) -> None:
        self.sent = b""

    def send(self, data: memoryview | bytes) -> int:
        self.sent += bytes(data)
        return len(data)

    def recv_into(self, view: memoryview, deadline: float | None = None) -> None:
        raise AssertionError("nothing is read here")


def test_the_bytes_of_each_message_are_pinned() -> None:
    """The format written out by hand, little-endian as every supported machine is: a push of a
    Linear(2, 1) (3 float32 values, padded to 16 bytes) with a BatchNorm1d(1)'s running mean and
    variance (2 float32 at 16, padded to 32), num_batches_tracked (an int64 at 32, padded to 48),
    SGD's lr, momentum and weight decay (3 float64 at 48, padded to 80) and which of the 2
    parameters have a gradient (2 uint8 at 80, padded to 96); the HELLO with its one parameter
    group, the refusal of a HELLO, the PING and the BEAT. A change here breaks every worker and
    server of another version."""
    assert (wire.HELLO, wire.PULL, wire.PUSH, wire.EXCHANGE, wire.DONE, wire.BARRIER) == (0, 1, 2, 3, 4, 5)
    assert (wire.CHECKPOINTED, wire.PING, wire.STOP, wire.BEAT, wire.REFUSED) == (6, 7, 8, -1, -2)
    f32 = torch.float32
    layout = wire.Layout([(f32, 2), (f32, 1)], [(f32, 1), (f32, 1)], [(torch.int64, 1)], hypers=3)
    assert (layout.request_bytes, layout.answer_bytes) == (96, 32)
    push = wire.Frame(layout.request_bytes)
    layout.params.pack(push, [torch.tensor([1.5, -2.0]), torch.tensor([0.25])])
    layout.floats.pack(push, [torch.tensor([3.0]), torch.tensor([0.5])])
    layout.ints.pack(push, [torch.tensor([7])])
    layout.hypers.whole(push).copy_(torch.tensor([0.05, 0.9, 1e-4], dtype=torch.float64))
    layout.present.whole(push).copy_(torch.tensor([1, 0], dtype=torch.uint8))  # the bias has no gradient
    stream = _Recorder()
    assert push.send(stream, wire.PUSH, 5, 64, 1) == 32 + 96
    assert stream.sent == (
        struct.pack("<4q", 2, 5, 64, 1)
        + struct.pack("<3f", 1.5, -2.0, 0.25)
        + bytes(4)
        + struct.pack("<2f", 3.0, 0.5)
        + bytes(8)
        + struct.pack("<q", 7)
        + bytes(8)
        + struct.pack("<3d", 0.05, 0.9, 1e-4)
        + bytes(8)
        + bytes([1, 0])
        + bytes(14)
    )
    # no buffers, no hyperparameters: not a byte for them, the presence right after the parameters
    assert wire.Layout([(f32, 2), (f32, 1)], [], [], hypers=0).request_bytes == 32
    assert wire.hello_message(3, b"run", rejoining=True) == struct.pack("<4q", 0, 3, 0, 1) + b"run" + bytes(29)
    assert wire.hello_message(1, bytes(range(40)))[32:] == bytes(range(32))  # a longer secret is cut
    group = (0b1011, 2, 12345)  # lr, momentum, weight_decay over 2 tensors; which ones: a digest
    hello = wire.hello_message(3, b"run", rejoining=True, groups=[group])
    assert hello == struct.pack("<4q", 0, 3, 1, 1) + b"run" + bytes(29) + struct.pack("<3q", *group)
    assert wire.read_hello(hello) == (0, 3, 1, True, b"run" + bytes(29))
    assert wire.unpack_groups(hello[wire.HELLO_BYTES :]) == [group]
    assert wire.refusal_message([group]) == struct.pack("<4q", -2, 1, 0, 0) + struct.pack("<3q", *group)
    assert wire.PING_MESSAGE == struct.pack("<4q", 7, 0, 0, 0)
    assert wire.BEAT_MESSAGE == struct.pack("<4q", -1, 0, 0, 0)
