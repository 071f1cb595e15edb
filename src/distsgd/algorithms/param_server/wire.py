"""The parameter server's wire format: what a worker and the server say to each other, byte by byte.

A message is one :class:`Frame`: a header of four int64 ``[op, version, samples, flag]`` (a
request) or ``[version, all workers' samples, stop, nbytes]`` (an answer), then a payload. Every
request (and every answer) of a run has the same size: the largest any op needs (a push's
gradient, buffers, the optimiser's hyperparameters and which parameters have a gradient, an
exchange's x); the control messages (pull, barrier, done) carry an unused payload. The payload's parts are the sections of a
:class:`Layout`, each aligned to :data:`ALIGN` bytes. Four messages are shorter: a worker's first,
the HELLO (a header, the run's secret and its optimiser's parameter groups, :func:`hello_message`),
the server's refusal of a HELLO whose groups are not its own (:func:`refusal_message`), a worker's
PING (a header alone, with no answer) and the server's BEAT (a header alone: no answer yet, the
server lives). Everything is raw tensor bytes in the machine's byte order: nothing is unpickled.
How these messages travel: :mod:`.transport`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

import torch

from distsgd.errors import ConfigError

HELLO, PULL, PUSH, EXCHANGE, DONE, BARRIER, CHECKPOINTED, PING, STOP = range(9)
HEAD = 4 * 8  # bytes of a header: four int64
BEAT = -1  # an answer's header [BEAT, 0, 0, 0], alone: no answer yet, the server lives (a version is >= 0)
REFUSED = -2  # the answer to a HELLO whose parameter groups are not the server's: [REFUSED, groups, 0, 0], its groups
BEAT_MESSAGE = struct.pack("4q", BEAT, 0, 0, 0)
PING_MESSAGE = struct.pack("4q", PING, 0, 0, 0)  # a worker is alive, busy between requests
SECRET_BYTES = 32  # the run's secret, which a HELLO carries after its header
HELLO_BYTES = HEAD + SECRET_BYTES  # then GROUP_BYTES for each of the optimiser's parameter groups
GROUP_BYTES = 3 * 8  # a parameter group, described: three int64 (.hyper.Hyperparameters.describe)
ALIGN = 16  # every section of a payload starts at a multiple of this: a view of any dtype is aligned

Groups = list[tuple[int, int, int]]  # an optimiser's parameter groups, as a HELLO describes them


def hello_message(rank: int, secret: bytes, rejoining: bool = False, groups: Groups | None = None) -> bytes:
    """What a worker sends first: the header [HELLO, rank, len(groups), rejoining], the run's secret
    and its optimiser's parameter groups (none under async EASGD, whose server never steps)."""
    groups = groups or []
    return struct.pack("4q", HELLO, rank, len(groups), int(rejoining)) + padded_secret(secret) + pack_groups(groups)


def read_hello(message: bytes | bytearray) -> tuple[int, int, int, bool, bytes]:
    """A HELLO's op (HELLO, unless it is not one), rank, how many parameter groups follow it (to be
    read: :func:`unpack_groups`), whether it replaces a dead worker, and secret."""
    op, rank, groups, rejoining = struct.unpack("4q", message[:HEAD])
    return op, rank, groups, bool(rejoining), bytes(message[HEAD:HELLO_BYTES])


def pack_groups(groups: Groups) -> bytes:
    return b"".join(struct.pack("3q", *g) for g in groups)


def unpack_groups(data: bytes | bytearray) -> Groups:
    return [struct.unpack_from("3q", data, i) for i in range(0, len(data) - len(data) % GROUP_BYTES, GROUP_BYTES)]


def refusal_message(groups: Groups) -> bytes:
    """The server's answer to a HELLO whose parameter groups are not its own: its own."""
    return struct.pack("4q", REFUSED, len(groups), 0, 0) + pack_groups(groups)


def padded_secret(secret: bytes) -> bytes:
    """``secret`` as a HELLO carries it: :data:`SECRET_BYTES` bytes, cut or padded with zeros."""
    return secret.ljust(SECRET_BYTES, b"\0")[:SECRET_BYTES]


class Stream(Protocol):
    """What a frame is sent on and read from (:class:`.transport.Channel`)."""

    def send(self, data: memoryview | bytes) -> int: ...

    def recv_into(self, view: memoryview, deadline: float | None = None) -> None: ...


def _align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


@dataclass(frozen=True)
class Section:
    """``numel`` values of ``dtype`` at byte ``offset`` of a payload: the tensors ``members``
    (indices into the list the section was made for), flat, one after another."""

    dtype: torch.dtype
    offset: int
    numel: int
    members: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


class Packing:
    """Where a list of tensors lies in a payload from byte ``start``: one section per dtype (in the
    order the dtypes first appear), each tensor's values in its dtype's section, in list order.
    Every section starts at a multiple of :data:`ALIGN` bytes, whatever the sizes before it, so a
    view of it in its dtype is possible (an int64 section after an odd number of float32 values)."""

    def __init__(self, tensors: list[tuple[torch.dtype, int]], start: int) -> None:
        groups: dict[torch.dtype, list[int]] = {}
        for i, (dtype, _) in enumerate(tensors):
            groups.setdefault(dtype, []).append(i)
        self.numels = [n for _, n in tensors]
        self.sections: list[Section] = []
        offset = _align(start)
        for dtype, members in groups.items():
            section = Section(dtype, offset, sum(self.numels[i] for i in members), tuple(members))
            self.sections.append(section)
            offset = _align(offset + section.nbytes)
        self.end = offset

    def pack(self, frame: Frame, tensors: list[torch.Tensor]) -> None:
        """Write ``tensors`` (of the sizes and dtypes this packing was made for) into ``frame``: one
        concatenation on the CPU, or from a GPU a concatenation there and one copy into the (pinned)
        frame, done when ``copy_`` returns (before the socket reads the bytes)."""
        for s in self.sections:
            if not s.numel:
                continue
            out = frame.section(s)
            parts = [tensors[i].detach().reshape(-1) for i in s.members]
            if parts[0].device.type == "cpu":
                torch.cat(parts, out=out)
            else:
                out.copy_(torch.cat(parts))

    def unpack(self, frame: Frame, clone: bool = False) -> list[torch.Tensor]:
        """The tensors in ``frame``, flat, in list order: views of the frame, or (``clone``) of one
        copy of each section."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(self.numels)
        for s in self.sections:
            flat = frame.section(s).clone() if clone else frame.section(s)
            offset = 0
            for i in s.members:
                out[i] = flat[offset : offset + self.numels[i]]
                offset += self.numels[i]
        return out

    def whole(self, frame: Frame) -> torch.Tensor:
        """A view of the one section of a packing of one dtype (the parameters: flat weights)."""
        assert len(self.sections) <= 1
        return frame.section(self.sections[0]) if self.sections else torch.empty(0)


class Layout:
    """What a message of a model holds, and where: its parameters (one dtype: the flat weights, a
    gradient or an exchange's x), its floating-point buffers, its other buffers (integer, bool),
    ``hypers`` float64 values (the optimiser's hyperparameters at a push's step:
    :mod:`.hyper`) and ``present``, one uint8 a parameter (a push's: 1 where the worker's
    parameter has a gradient, 0 where it has none, frozen or unused in the forward, and its
    gradient's values are zeros; nothing else is valid), each part in aligned sections. A request
    holds all five (an exchange ignores the last two); an answer the first two (weights, or an
    exchange's difference). The server and each worker build it from the same architecture and the
    same optimiser factory."""

    def __init__(
        self,
        params: list[tuple[torch.dtype, int]],
        floats: list[tuple[torch.dtype, int]],
        ints: list[tuple[torch.dtype, int]],
        hypers: int = 0,
    ) -> None:
        if len({dtype for dtype, _ in params}) > 1:
            raise ConfigError(
                f"the parameter server keeps the weights as one flat tensor; this model's parameters "
                f"have several dtypes ({', '.join(sorted({str(d) for d, _ in params}))}): give them one"
            )
        self.params = Packing(params, 0)
        self.floats = Packing(floats, self.params.end)
        self.ints = Packing(ints, self.floats.end)
        self.hypers = Packing([(torch.float64, hypers)] if hypers else [], self.ints.end)
        self.present = Packing([(torch.uint8, len(params))] if params else [], self.hypers.end)
        self.request_bytes = self.present.end
        self.answer_bytes = self.floats.end

    @classmethod
    def of(cls, model: torch.nn.Module, hypers: int = 0) -> Layout:
        buffers = list(model.buffers())
        return cls(
            [(p.dtype, p.numel()) for p in model.parameters()],
            [(b.dtype, b.numel()) for b in buffers if b.dtype.is_floating_point],
            [(b.dtype, b.numel()) for b in buffers if not b.dtype.is_floating_point],
            hypers,
        )


class Frame:
    """One message: an int64 header ``[a, b, c, d]`` and a payload of ``nbytes``, in one byte
    buffer, so that a request or an answer is one send."""

    def __init__(self, nbytes: int, pinned: bool = False) -> None:
        # pinned (a GPU worker's): a gradient comes off the GPU, and weights go onto it, in one copy each
        self.buffer = torch.zeros(HEAD + nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.head = self.buffer[:HEAD].view(torch.int64)
        self.view = self.buffer.numpy().data  # a memoryview: what the socket reads into and writes from

    def section(self, s: Section) -> torch.Tensor:
        """A view of section ``s`` of the payload, in its dtype."""
        return self.buffer[HEAD + s.offset : HEAD + s.offset + s.nbytes].view(s.dtype)

    def send(self, stream: Stream, *head: int) -> int:
        self.head.copy_(torch.tensor(head, dtype=torch.int64))
        return stream.send(self.view)

    def recv(self, stream: Stream) -> list[int]:
        stream.recv_into(self.view)
        return self.head.tolist()

    def recv_head(self, stream: Stream) -> list[int]:
        """The header alone (the server: a PING has nothing more); then :meth:`recv_payload`."""
        stream.recv_into(self.view[:HEAD])
        return self.head.tolist()

    def recv_payload(self, stream: Stream, deadline: float | None = None) -> None:
        stream.recv_into(self.view[HEAD:], deadline)
