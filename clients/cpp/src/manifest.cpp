// Reading the manifest deltad.consume.export writes next to a TorchScript artifact.
#include "deltad/manifest.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "deltad/consumer.h"

namespace deltad {

Manifest Manifest::load(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw ConfigError("cannot read the artifact's manifest " + path);
  Manifest m;
  try {
    nlohmann::json j = nlohmann::json::parse(f);
    if (j.value("format", "") != "deltad-torchscript-1")
      throw ConfigError(path + ": not a deltad-torchscript-1 manifest");
    for (const auto& t : j.at("tbes")) {
      std::map<std::string, std::string> names;
      for (const char* k : {"weights_host", "weights_uvm", "weights_placements", "weights_offsets",
                            "weights_tys", "D_offsets"})
        names[k] = t.at(k).get<std::string>();
      m.tbes.push_back(names);
      m.tbe_row_alignment.push_back(t.at("row_alignment").get<int64_t>());
    }
    for (const auto& t : j.at("tables")) {
      TableSpec s;
      s.name = t.at("name").get<std::string>();
      s.num_rows = t.at("num_rows").get<int64_t>();
      s.dim = t.at("dim").get<int64_t>();
      s.dtype = t.at("dtype").get<std::string>();
      s.row_bytes = t.at("row_bytes").get<int64_t>();
      s.data_bytes = t.at("data_bytes").get<int64_t>();
      s.scale_bias_last = t.at("scale_bias_last").get<bool>();
      s.tbe = t.at("tbe").get<int>();
      s.index = t.at("index").get<int>();
      s.offset = t.at("offset").get<int64_t>();
      if (s.tbe < 0 || size_t(s.tbe) >= m.tbes.size())
        throw ConfigError(path + ": table " + s.name + " of TBE " + std::to_string(s.tbe));
      if (t.contains("mc")) {
        s.mc = true;
        s.mc_sorted = t.at("mc").at("sorted_raw_ids").get<std::string>();
        s.mc_mapping = t.at("mc").at("mapping").get<std::string>();
        s.mc_offset = t.at("mc").at("offset").get<int64_t>();
      }
      m.tables.push_back(s);
    }
    for (const auto& [k, v] : j.at("dense").items()) m.dense[k] = v.get<std::string>();
    for (const auto& v : j.value("unused_dense", nlohmann::json::array()))
      m.unused_dense.push_back(v.get<std::string>());
    for (const auto& v : j.value("examples", nlohmann::json::array()))
      m.examples.push_back(v.get<std::string>());
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(path + ": not a deltad manifest (" + e.what() + ")");
  }
  return m;
}

}  // namespace deltad
