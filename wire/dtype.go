package wire

import "fmt"

// DType is a tensor element type. The numeric values are part of the wire
// protocol (the Python side and the data-plane descriptors use them) and
// must not change.
type DType uint8

// Element types.
const (
	Invalid      DType = 0
	Bool         DType = 1
	Uint8        DType = 2
	Int8         DType = 3
	Int16        DType = 4
	Int32        DType = 5
	Int64        DType = 6
	Float16      DType = 7
	BFloat16     DType = 8
	Float32      DType = 9
	Float64      DType = 10
	Complex64    DType = 11
	Complex128   DType = 12
	Float8E4M3FN DType = 13
	Float8E5M2   DType = 14
	Uint16       DType = 15
	Uint32       DType = 16
	Uint64       DType = 17
)

type dtypeInfo struct {
	name string // torch name, without the "torch." prefix
	size int    // bytes per element
}

var dtypes = [...]dtypeInfo{
	Bool:         {"bool", 1},
	Uint8:        {"uint8", 1},
	Int8:         {"int8", 1},
	Int16:        {"int16", 2},
	Int32:        {"int32", 4},
	Int64:        {"int64", 8},
	Float16:      {"float16", 2},
	BFloat16:     {"bfloat16", 2},
	Float32:      {"float32", 4},
	Float64:      {"float64", 8},
	Complex64:    {"complex64", 8},
	Complex128:   {"complex128", 16},
	Float8E4M3FN: {"float8_e4m3fn", 1},
	Float8E5M2:   {"float8_e5m2", 1},
	Uint16:       {"uint16", 2},
	Uint32:       {"uint32", 4},
	Uint64:       {"uint64", 8},
}

// Valid reports whether d is one of the defined dtypes (not Invalid).
func (d DType) Valid() bool { return d != Invalid && int(d) < len(dtypes) }

// Size returns the number of bytes per element, or 0 for Invalid and
// unknown values.
func (d DType) Size() int {
	if !d.Valid() {
		return 0
	}
	return dtypes[d].size
}

// String returns the torch name of the dtype ("float32", "bfloat16",
// "float8_e4m3fn", ...).
func (d DType) String() string {
	if !d.Valid() {
		if d == Invalid {
			return "invalid"
		}
		return fmt.Sprintf("dtype(%d)", uint8(d))
	}
	return dtypes[d].name
}

// RedOp is a reduction operation. The numeric values are part of the wire
// protocol and must not change.
type RedOp uint8

// Reduction operations.
const (
	Sum     RedOp = 1
	Avg     RedOp = 2
	Product RedOp = 3
	Min     RedOp = 4
	Max     RedOp = 5
	BAnd    RedOp = 6
	BOr     RedOp = 7
	BXor    RedOp = 8
)

var opNames = [...]string{
	Sum: "sum", Avg: "avg", Product: "product", Min: "min", Max: "max",
	BAnd: "band", BOr: "bor", BXor: "bxor",
}

// Valid reports whether o is one of the defined reduction ops.
func (o RedOp) Valid() bool { return o != 0 && int(o) < len(opNames) }

// String returns the lower-case name of the op ("sum", "avg", ...).
func (o RedOp) String() string {
	if o == 0 || int(o) >= len(opNames) {
		return fmt.Sprintf("op(%d)", uint8(o))
	}
	return opNames[o]
}
