// The JSON manifest of a TorchScript artifact (deltad.consume.export): where each table's rows live.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace deltad {

struct TableSpec {
  std::string name;
  int64_t num_rows = 0, dim = 0;
  std::string dtype;  // int8, int4, fp16, fp32
  int64_t row_bytes = 0, data_bytes = 0;
  bool scale_bias_last = false;
  int tbe = 0;
  int index = 0;
  int64_t offset = 0;  // byte offset of its first row in the TBE's weights_host
  bool mc = false;
  std::string mc_sorted, mc_mapping;
  int64_t mc_offset = 0;
};

struct Manifest {
  std::vector<std::map<std::string, std::string>> tbes;  // buffer -> attribute
  std::vector<int64_t> tbe_row_alignment;
  std::vector<TableSpec> tables;
  std::map<std::string, std::string> dense;  // state_dict name -> attribute
  std::vector<std::string> unused_dense;
  std::vector<std::string> examples;
  static Manifest load(const std::string& path);  // ConfigError if unreadable / not one
};

}  // namespace deltad
