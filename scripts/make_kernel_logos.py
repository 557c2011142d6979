"""Draw kernelspec/remotecuda/logo-{32x32,64x64}.png (a GPU chip with pins, on a
transparent background) with zlib + struct only. Run from the repository root."""
from __future__ import annotations

import os
import struct
import zlib

GREEN = (118, 185, 0, 255)
DARK = (32, 36, 40, 255)
CLEAR = (0, 0, 0, 0)


def pixel(x: float, y: float) -> tuple:
    """Colour at (x, y) in the unit square."""
    if 0.22 <= x <= 0.78 and 0.22 <= y <= 0.78:  # the die: dark, with a green core
        if 0.36 <= x <= 0.64 and 0.36 <= y <= 0.64:
            return GREEN
        return DARK
    for c in (0.31, 0.44, 0.56, 0.69):  # pins on the four sides
        near = abs(x - c) < 0.035 if (y < 0.22 or y > 0.78) else abs(y - c) < 0.035
        if near and (0.08 <= x <= 0.92 and 0.08 <= y <= 0.92):
            return GREEN
    return CLEAR


def png(size: int) -> bytes:
    rows = b""
    for j in range(size):
        rows += b"\x00" + b"".join(bytes(pixel((i + 0.5) / size, (j + 0.5) / size)) for i in range(size))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 6, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


if __name__ == "__main__":
    for n in (32, 64):
        path = os.path.join("kernelspec", "remotecuda", f"logo-{n}x{n}.png")
        with open(path, "wb") as f:
            f.write(png(n))
        print(path)
