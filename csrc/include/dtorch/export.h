// DTORCH_API marks what libdtorch_ops.so exports to C++ users: the library is built with
// -fvisibility=hidden, so nothing else of it is visible outside it. (The project's own other
// binaries use a few internal entry points too; those are DTORCH_INTERNAL_API, declared in
// csrc/ops/internal_api.h, which is not installed.)
#pragma once

#define DTORCH_API __attribute__((visibility("default")))
