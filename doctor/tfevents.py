"""
TensorBoard event files (events.out.tfevents.*), as torch.utils.tensorboard's SummaryWriter,
tensorboardX and TensorFlow write them, read (and, for train_grpo.py's tensorboard_log, written:
scalar_event, start_events) without importing any of them: the file is a sequence
of records, each [length: uint64][masked CRC-32C of the length][data][masked CRC-32C of the data],
and each record's data is an Event protocol buffer (tensorflow/core/util/event.proto): wall_time = 1
(double), step = 2 (int64), summary = 5, whose values (Summary.Value = 1) carry a tag = 1 and either
simple_value = 2 (a float: SummaryWriter.add_scalar) or tensor = 8 (TF2's tf.summary.scalar: a
TensorProto with dtype = 1, tensor_shape = 2, tensor_content = 4 or float_val = 5, double_val = 6,
int_val = 7, int64_val = 10). Only numeric scalars are read; images, histograms and text pass by.
"""
import struct


def _crc32c_table():
    table = []
    for n in range(256):
        for _ in range(8):
            n = (n >> 1) ^ 0x82F63B78 if n & 1 else n >> 1  # Castagnoli, reflected
        table.append(n)
    return table


CRC_TABLE = _crc32c_table()
TF_DTYPES = {1: ('<f', 4), 2: ('<d', 8), 3: ('<i', 4), 9: ('<q', 8)}  # float, double, int32, int64


def masked_crc(data):
    """The record format's checksum: CRC-32C, rotated right by 15 bits, plus a constant."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(data):
    """(record data or None, problem or None) of an event file's bytes, in order. A record whose data
    fails its checksum gives (None, why) and the next is read; a length that fails its checksum or a
    record cut short (a crash mid-write) ends the file with (None, why)."""
    i, n = 0, 0
    while i < len(data):
        head = data[i:i + 12]
        if len(head) < 12:
            yield None, f"cut short after record {n} (the last write did not finish)"
            return
        length, length_crc = struct.unpack('<QI', head)
        if masked_crc(head[:8]) != length_crc:
            yield None, (f"record {n + 1}'s length fails its checksum (not an event file, or "
                         f"damaged); the {n} records before it are read")
            return
        body = data[i + 12:i + 12 + length]
        tail = data[i + 12 + length:i + 16 + length]
        if len(body) < length or len(tail) < 4:
            yield None, f"cut short in record {n + 1} (the last write did not finish)"
            return
        i, n = i + 16 + length, n + 1
        if masked_crc(body) != struct.unpack('<I', tail)[0]:
            yield None, f"record {n}'s data fails its checksum; skipped"
            continue
        yield body, None


def varint(buf, i):
    """(value, next index) of the base-128 varint at buf[i]. Raises ValueError past the end."""
    value, shift = 0, 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("a varint runs past its message")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return value, i


def fields(buf):
    """(field number, wire type, value) of each field of a protocol buffer message: a varint as an
    int, the others as their bytes. Raises ValueError on a message cut short or of an unknown wire
    type."""
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        kind = key & 7
        if kind == 0:
            value, i = varint(buf, i)
        elif kind in (1, 5):  # fixed 64 and 32 bits
            size = 8 if kind == 1 else 4
            value, i = buf[i:i + size], i + size
        elif kind == 2:  # length-delimited: bytes, strings, messages, packed repeated numbers
            size, i = varint(buf, i)
            value, i = buf[i:i + size], i + size
        else:
            raise ValueError(f"wire type {kind}")
        if i > len(buf):
            raise ValueError("a field runs past its message")
        yield key >> 3, kind, value


def signed(v, bits=64):
    return v - (1 << bits) if v >= 1 << (bits - 1) else v


def numbers(kind, value, fmt, size):
    """The numbers of a repeated numeric field, packed (one length-delimited run) or not; fmt None:
    varints. Raises ValueError on a wire type the field cannot have."""
    if kind == 0:
        return [signed(value)]
    if kind == 2 and fmt is None:  # packed varints
        out, i = [], 0
        while i < len(value):
            v, i = varint(value, i)
            out.append(signed(v))
        return out
    if kind == 2:
        return [x for (x,) in struct.iter_unpack(fmt, value[:len(value) // size * size])]
    if fmt is None or len(value) != size:
        raise ValueError(f"wire type {kind} for a number of {size or 'varint'} bytes")
    return [struct.unpack(fmt, value)[0]]


def tensor_scalar(buf):
    """The number a TensorProto holds when it is one numeric element, else None."""
    dtype, dims, content, values = None, [], b'', []
    for num, kind, value in fields(buf):
        if num == 1 and kind == 0:
            dtype = value
        elif num == 2 and kind == 2:  # TensorShapeProto: dim = 2, each Dim's size = 1
            dims = [signed(size) for n, _, dim in fields(value) if n == 2
                    for k, _, size in fields(dim) if k == 1]
        elif num == 4 and kind == 2:
            content = value
        elif num in (5, 6):
            values += numbers(kind, value, *(('<f', 4) if num == 5 else ('<d', 8)))
        elif num in (7, 10):
            values += numbers(kind, value, None, 0)
    if dtype not in TF_DTYPES or any(d != 1 for d in dims):
        return None
    fmt, size = TF_DTYPES[dtype]
    if content:
        return float(struct.unpack(fmt, content)[0]) if len(content) == size else None
    return float(values[0]) if len(values) == 1 else None


def scalars(event):
    """(step, tag, value) of each numeric scalar in one Event's summary."""
    step, summaries = 0, []
    for num, kind, value in fields(event):
        if num == 2 and kind == 0:
            step = signed(value)
        elif num == 5 and kind == 2:
            summaries.append(value)
    for summary in summaries:
        for num, kind, value in fields(summary):
            if num != 1 or kind != 2:
                continue
            tag, x = None, None
            for n, k, v in fields(value):
                if n == 1 and k == 2:
                    tag = v.decode('utf-8', 'replace')
                elif n == 2 and k == 5:
                    x = float(struct.unpack('<f', v)[0])
                elif n == 8 and k == 2:
                    x = tensor_scalar(v)
            if tag is not None and x is not None:
                yield step, tag, x


# ------------------------------------------------------------------------------------ writing

def _varint(n):
    out = bytearray()
    n &= (1 << 64) - 1  # a negative int64 as protobuf writes it: ten bytes
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num, kind, value):
    """One field: a varint (kind 0, an int), fixed 64 or 32 bits (1, 5: the bytes) or
    length-delimited (2: the bytes)."""
    key = _varint(num << 3 | kind)
    if kind == 0:
        return key + _varint(value)
    if kind == 2:
        return key + _varint(len(value)) + value
    return key + value


def record(event):
    """An Event's bytes framed as the file holds them (the reader's records(), inverted)."""
    length = struct.pack('<Q', len(event))
    return (length + struct.pack('<I', masked_crc(length)) + event +
            struct.pack('<I', masked_crc(event)))


def _event(wall_time, step, *fields_):
    return _field(1, 1, struct.pack('<d', wall_time)) + _field(2, 0, step) + b''.join(fields_)


def start_events(wall_time, step):
    """A file's first records, as SummaryWriter(purge_step=step) writes them: the format version,
    then SessionLog START at step, which tells TensorBoard to hide what earlier files logged at step
    and after (the steps a resumed run does again)."""
    version = _event(wall_time, step, _field(3, 2, b'brain.Event:2'))
    start = _event(wall_time, step, _field(7, 2, _field(1, 0, 1)))  # session_log {status: START}
    return record(version) + record(start)


def scalar_event(wall_time, step, values):
    """One record of an Event holding values ({tag: number}) as simple_value scalars, as
    SummaryWriter.add_scalar writes each (float32)."""
    summary = b''.join(_field(1, 2, _field(1, 2, tag.encode()) + _field(2, 5, struct.pack('<f', value)))
                       for tag, value in values.items())
    return record(_event(wall_time, step, _field(5, 2, summary)))

