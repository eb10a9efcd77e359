#include "settings.h"

#include <algorithm>
#include <mutex>
#include <stdexcept>

namespace dtorch::core {
namespace {

struct Table {
  std::mutex mu;
  std::vector<Setting> sorted;  // guarded by mu: by ascending order
};

Table& Registered() {
  static auto* table = new Table();  // leaked: read until the process ends
  return *table;
}

Setting Find(std::string_view name) {
  auto& table = Registered();
  std::lock_guard<std::mutex> lock(table.mu);
  for (const auto& setting : table.sorted) {
    if (setting.name == name) return setting;
  }
  throw std::out_of_range("dtorch: no setting is named '" + std::string(name.substr(0, 64)) + "'");
}

}  // namespace

bool RegisterSetting(Setting setting) {
  auto& table = Registered();
  std::lock_guard<std::mutex> lock(table.mu);
  const auto at = std::upper_bound(table.sorted.begin(), table.sorted.end(), setting.order,
                                   [](int order, const Setting& s) { return order < s.order; });
  table.sorted.insert(at, std::move(setting));
  return true;
}

std::vector<Setting> AllSettings() {
  auto& table = Registered();
  std::lock_guard<std::mutex> lock(table.mu);
  return table.sorted;
}

int64_t GetSetting(std::string_view name) { return Find(name).get(); }

void SetSetting(std::string_view name, int64_t value) { Find(name).set(value); }

}  // namespace dtorch::core
