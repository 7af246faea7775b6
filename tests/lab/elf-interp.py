#!/usr/bin/env python3
"""Copy an x86-64 ELF executable with another program interpreter (PT_INTERP), for the lab's
Slurm 24.11 leg (tests/lab/slurm24.sh): slurmctld re-executes itself through /proc/self/exe
(slurmscriptd), so it cannot run through an explicitly invoked loader; its copy names the root's
loader itself and finds the root's libraries through LD_LIBRARY_PATH.

    tests/lab/elf-interp.py SRC DST INTERP     (INTERP no longer than the original path)
"""
import os
import struct
import sys


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: elf-interp.py SRC DST INTERP")
    src, dst, interp = sys.argv[1], sys.argv[2], sys.argv[3].encode()
    with open(src, "rb") as f:
        data = bytearray(f.read())
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        sys.exit(f"{src}: not a 64-bit little-endian ELF file")
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        off = phoff + i * phentsize
        ptype, = struct.unpack_from("<I", data, off)
        if ptype != 3:  # PT_INTERP
            continue
        p_offset, = struct.unpack_from("<Q", data, off + 8)
        p_filesz, = struct.unpack_from("<Q", data, off + 32)
        if len(interp) + 1 > p_filesz:
            sys.exit(f"{src}: interpreter path {sys.argv[3]} is longer than the {p_filesz - 1} bytes there is room for")
        data[p_offset:p_offset + p_filesz] = interp + b"\0" * (p_filesz - len(interp))
        tmp = f"{dst}.new.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
        return
    sys.exit(f"{src}: no PT_INTERP (not a dynamically linked executable)")


main()
