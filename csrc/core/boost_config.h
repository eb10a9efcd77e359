// The Boost this library is built against, checked at build time (torch-free). Include it before
// any Boost header.
//
// Boost >= 1.78: from 1.78 on, Boost.Interprocess mutexes on Linux are robust (PTHREAD_MUTEX_ROBUST:
// a peer that dies holding one does not leave it locked for good), provided
// BOOST_INTERPROCESS_POSIX_ROBUST_MUTEXES ends up defined, which it is on POSIX.1-2008 systems.
// Debian 12 ships 1.74 as libboost-dev: scripts/install_deps.sh installs libboost1.81-dev there.
#pragma once

#include <boost/version.hpp>
#include <boost/interprocess/detail/workaround.hpp>

static_assert(BOOST_VERSION >= 107800,
              "dtorch_ops needs Boost >= 1.78 (robust interprocess mutexes): on Debian 12 install "
              "libboost1.81-dev (scripts/install_deps.sh does), or point DTORCH_BOOST_INCLUDE at "
              "a newer Boost's include directory");
#if !defined(BOOST_INTERPROCESS_POSIX_ROBUST_MUTEXES)
#error "dtorch_ops needs robust Boost.Interprocess mutexes (BOOST_INTERPROCESS_POSIX_ROBUST_MUTEXES)"
#endif
