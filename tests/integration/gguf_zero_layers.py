#!/usr/bin/env python3
"""gguf_zero_layers.py IN OUT: copy the GGUF file IN to OUT with every layer tensor (blk.*)
zeroed except the norms, so that each layer adds exactly 0 to the residual stream and the
logits are output(norm(embedding)): one quantised matmul whose input is computed the same
way, to the bit, by any engine. Used by models_ref_quant.sh to test the activation
quantisation and the dot of each weight type alone.

GGUF v2/v3 layout read here (little-endian): "GGUF", u32 version, u64 tensor count, u64
metadata count; each metadata entry is a string key, a u32 value type and the value; each
tensor entry is a string name, u32 n_dims, u64 dims[n_dims], u32 type, u64 offset from the
start of the data section, which begins at the next multiple of general.alignment (32 by
default) after the entries. Only F32 (type 0) and F16 (type 1) layer tensors are expected.
"""
import struct
import sys

SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q",
          12: "d"}
ELEM_BYTES = {0: 4, 1: 2}


class Reader:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt):
        (v,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v

    def string(self):
        n = self.take("Q")
        s = bytes(self.data[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype):
        if vtype == 8:
            return self.string()
        if vtype == 9:
            etype, n = self.take("I"), self.take("Q")
            return [self.value(etype) for _ in range(n)]
        return self.take(SCALAR[vtype])


def main():
    src, dst = sys.argv[1], sys.argv[2]
    data = bytearray(open(src, "rb").read())
    r = Reader(data)
    if bytes(data[:4]) != b"GGUF":
        sys.exit(f"{src}: not a GGUF file")
    r.pos = 4
    r.take("I")
    n_tensors, n_kv = r.take("Q"), r.take("Q")
    align = 32
    for _ in range(n_kv):
        key, vtype = r.string(), r.take("I")
        v = r.value(vtype)
        if key == "general.alignment":
            align = v
    tensors = []
    for _ in range(n_tensors):
        name, n_dims = r.string(), r.take("I")
        dims = [r.take("Q") for _ in range(n_dims)]
        tensors.append((name, dims, r.take("I"), r.take("Q")))
    base = (r.pos + align - 1) // align * align
    n_zeroed = 0
    for name, dims, ttype, offset in tensors:
        if not name.startswith("blk.") or "norm" in name:
            continue
        if ttype not in ELEM_BYTES:
            sys.exit(f"{name}: type {ttype}, only F32 and F16 layer tensors are zeroed")
        size = ELEM_BYTES[ttype]
        for d in dims:
            size *= d
        if base + offset + size > len(data):
            sys.exit(f"{name}: data past the end of the file")
        data[base + offset:base + offset + size] = bytes(size)
        n_zeroed += 1
    if n_zeroed == 0:
        sys.exit(f"{src}: no layer tensor to zero")
    open(dst, "wb").write(data)


main()
