// The library's process-wide settings as one table (torch-free): each is registered once, by the
// part of the library it tunes, with its name, unit, bounds, default, documentation and accessors.
// dtorch_ops.config (Python) and docs/reference/settings.md are built from this table; C++
// programs share the same values (internal_api.h: Setting, SetSetting).
//
// Values are integers in the held unit: a count, or milliseconds for a setting in seconds (Python
// sets and shows seconds). The setter is the authority on bounds: it throws std::invalid_argument
// for a value out of them, saying the bound; `minimum`/`maximum` say the same for the reference,
// and test_core checks that they agree. A time of at least kMaxTimeoutMs means "never".
//
// Lifetime: settings register from static initializers of the library (RegisterSetting returns
// true, for `const bool registered = RegisterSetting(...)`) and stay registered.
//
// Thread-safety: every function may be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dtorch::core {

struct Setting {
  enum class Unit { kCount, kSeconds };  // kSeconds: held in milliseconds
  std::string name;  // as Python spells it: dtorch_ops.config.<name>
  Unit unit = Unit::kCount;
  int64_t default_value = 0;
  int64_t minimum = 0;
  int64_t maximum = 0;
  std::string doc;  // one paragraph: what it tunes, and when to change it
  int64_t (*get)() = nullptr;
  void (*set)(int64_t) = nullptr;  // throws std::invalid_argument (out of bounds), std::logic_error
  int order = 0;                   // where it is listed (ascending)
};

bool RegisterSetting(Setting setting);
// Every setting, in listing order.
std::vector<Setting> AllSettings();
// Throws std::out_of_range for a name no setting has.
int64_t GetSetting(std::string_view name);
void SetSetting(std::string_view name, int64_t value);

}  // namespace dtorch::core
