#!/usr/bin/env python3
"""Copy an x86-64 ELF executable with another program interpreter (PT_INTERP) and, optionally,
another library search path, for the lab's Slurm 24.11 leg (tests/lab/slurm24.sh): slurmctld
(slurmscriptd) and slurmd (its script launcher, which runs the SPANK prolog/epilog) re-execute
themselves through /proc/self/exe, so they cannot run through an explicitly invoked loader; their
copies name the root's loader themselves and find the root's libraries either through
LD_LIBRARY_PATH or, with LIBDIR, through a DT_RPATH (the DT_RUNPATH entry turned into DT_RPATH,
which also serves the libraries' own dependencies, its string replaced by LIBDIR).

    tests/lab/elf-interp.py SRC DST INTERP [LIBDIR]   (each no longer than what it replaces)
"""
import os
import struct
import sys


def main():
    if len(sys.argv) not in (4, 5):
        sys.exit("usage: elf-interp.py SRC DST INTERP [LIBDIR]")
    src, dst, interp = sys.argv[1], sys.argv[2], sys.argv[3].encode()
    libdir = sys.argv[4].encode() if len(sys.argv) == 5 else None
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
        if libdir is not None:
            set_rpath(data, src, phoff, phentsize, phnum, libdir)
        try:
            with open(dst, "rb") as f:
                if f.read() == data:
                    return  # unchanged: a daemon running from dst keeps a file that still exists
        except OSError:
            pass
        tmp = f"{dst}.new.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
        return
    sys.exit(f"{src}: no PT_INTERP (not a dynamically linked executable)")


def set_rpath(data, src, phoff, phentsize, phnum, libdir):
    loads, dynamic = [], None
    for i in range(phnum):
        off = phoff + i * phentsize
        ptype, = struct.unpack_from("<I", data, off)
        p_offset, p_vaddr = struct.unpack_from("<QQ", data, off + 8)
        p_filesz, = struct.unpack_from("<Q", data, off + 32)
        if ptype == 1:  # PT_LOAD
            loads.append((p_vaddr, p_offset, p_filesz))
        elif ptype == 2:  # PT_DYNAMIC
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        sys.exit(f"{src}: no PT_DYNAMIC")

    def file_offset(vaddr):
        for v, o, n in loads:
            if v <= vaddr < v + n:
                return o + vaddr - v
        sys.exit(f"{src}: address {vaddr:#x} is in no PT_LOAD segment")

    entries = []
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:
            break
        entries.append((off, tag, val))
    strtab = [val for _, tag, val in entries if tag == 5]  # DT_STRTAB
    paths = [(off, val) for off, tag, val in entries if tag in (0x1D, 0x0F)]  # DT_RUNPATH, DT_RPATH
    if not strtab or len(paths) != 1:
        sys.exit(f"{src}: expected one DT_RUNPATH or DT_RPATH and a DT_STRTAB")
    off, val = paths[0]
    at = file_offset(strtab[0]) + val
    end = data.index(b"\0", at)
    if len(libdir) > end - at:
        sys.exit(f"{src}: library directory {libdir.decode()} is longer than the {end - at} bytes there is room for")
    data[at:end] = libdir + b"\0" * (end - at - len(libdir))
    struct.pack_into("<q", data, off, 0x0F)


main()
