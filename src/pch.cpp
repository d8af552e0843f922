// The translation unit that compiles src/pch.h once for every target that reuses it (CMakeLists.txt).
