// Forwarding header, kept for programs written against earlier versions: include
// <dtorch/dtorch.h>.
#pragma once

#include "dtorch/dtorch.h"
