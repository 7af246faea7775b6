#!/usr/bin/env python3
"""Print the Slurm major.minor (YY.MM) a SPANK plugin was built for.

Reads the plugin's exported `plugin_version` (a uint32 SLURM_VERSION_NUMBER, 0xYYMMPP) from the
ELF file itself, as Slurm's loader does after dlopen, without loading it: rpm/build.sh checks
that the packaged plugin matches the major.minor its `Requires` pins, and the lab checks which
plugin it installs.

    rpm/plugin-slurm-version.py PLUGIN.so        ->  24.11   (exit 1 with a message otherwise)
"""
import struct
import sys


def plugin_version(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        name, typ, flags, addr, off, size, link, info, align, entsize = struct.unpack_from(
            "<IIQQQQIIQQ", data, shoff + i * shentsize)
        sections.append((typ, flags, addr, off, size, link, entsize))
    SHT_DYNSYM, SHF_ALLOC, SHT_NOBITS = 11, 2, 8
    for typ, _flags, _addr, off, size, link, entsize in sections:
        if typ != SHT_DYNSYM:
            continue
        stroff = sections[link][3]
        for j in range(size // entsize):
            st_name, _info, _other, shndx, value, st_size = struct.unpack_from("<IBBHQQ", data, off + j * entsize)
            end = data.index(b"\0", stroff + st_name)
            if data[stroff + st_name:end] != b"plugin_version" or shndx == 0 or st_size != 4:
                continue
            s_typ, s_flags, s_addr, s_off, s_size, _l, _e = sections[shndx]
            if not s_flags & SHF_ALLOC or s_typ == SHT_NOBITS or not s_addr <= value < s_addr + s_size:
                raise ValueError("plugin_version is not in an initialised section")
            return struct.unpack_from("<I", data, s_off + value - s_addr)[0]
    raise ValueError("no exported 4-byte plugin_version (not a Slurm plugin?)")


def main():
    if len(sys.argv) != 2:
        sys.stderr.write("usage: plugin-slurm-version.py PLUGIN.so\n")
        return 2
    try:
        v = plugin_version(sys.argv[1])
    except (OSError, ValueError, struct.error, IndexError) as e:
        sys.stderr.write(f"plugin-slurm-version.py: {sys.argv[1]}: {e}\n")
        return 1
    sys.stdout.write("%02d.%02d\n" % ((v >> 16) & 0xFF, (v >> 8) & 0xFF))
    return 0


if __name__ == "__main__":
    sys.exit(main())
