//! The ggml element types a GGUF tensor may be stored in, with their block geometry.
//!
//! Quantized types pack `block_size()` elements into `type_size()` bytes; plain types are blocks
//! of one element. A tensor's byte length is `n_elements / block_size * type_size`, defined only
//! when the element count is a whole number of blocks.

use std::fmt;

/// Elements per super-block of the k-quant types.
pub const QK_K: usize = 256;

/// A ggml tensor type, with the numeric id the GGUF tensor table stores.
///
/// Every id the GGUF spec still assigns is listed, so the reader can index any file; only some of
/// them can be dequantized (see [`super::dequant::dequantize`]). Ids the spec has retired (4, 5,
/// 31–33, 36–38) are rejected as unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

/// (type, id, elements per block, bytes per block), in declaration order: the single table every
/// lookup reads.
const TABLE: [(GgmlType, u32, usize, usize); 34] = {
    use GgmlType::*;
    [
        (F32, 0, 1, 4),
        (F16, 1, 1, 2),
        (Q4_0, 2, 32, 2 + 16),
        (Q4_1, 3, 32, 2 + 2 + 16),
        (Q5_0, 6, 32, 2 + 4 + 16),
        (Q5_1, 7, 32, 2 + 2 + 4 + 16),
        (Q8_0, 8, 32, 2 + 32),
        (Q8_1, 9, 32, 4 + 4 + 32),
        (Q2_K, 10, QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
        (Q3_K, 11, QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
        (Q4_K, 12, QK_K, 2 + 2 + QK_K / 2 + 12),
        (Q5_K, 13, QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
        (Q6_K, 14, QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
        (Q8_K, 15, QK_K, 4 + QK_K + QK_K / 8),
        (IQ2_XXS, 16, QK_K, 2 + QK_K / 4),
        (IQ2_XS, 17, QK_K, 2 + QK_K / 4 + QK_K / 32),
        (IQ3_XXS, 18, QK_K, 2 + QK_K / 4 + QK_K / 8),
        (IQ1_S, 19, QK_K, 2 + QK_K / 8 + QK_K / 16),
        (IQ4_NL, 20, 32, 2 + 16),
        (IQ3_S, 21, QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
        (IQ2_S, 22, QK_K, 2 + QK_K / 4 + QK_K / 16),
        (IQ4_XS, 23, QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
        (I8, 24, 1, 1),
        (I16, 25, 1, 2),
        (I32, 26, 1, 4),
        (I64, 27, 1, 8),
        (F64, 28, 1, 8),
        (IQ1_M, 29, QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
        (BF16, 30, 1, 2),
        (TQ1_0, 34, QK_K, 2 + 4 * 13),
        (TQ2_0, 35, QK_K, 2 + 64),
        (MXFP4, 39, 32, 1 + 16),
        (NVFP4, 40, 64, 4 + 32),
        (Q1_0, 41, 128, 2 + 16),
    ]
};

impl GgmlType {
    /// The type with GGUF id `id`, or `None` for an id the spec does not (or no longer) assign.
    pub fn from_id(id: u32) -> Option<Self> {
        TABLE.iter().find(|row| row.1 == id).map(|row| row.0)
    }

    fn row(self) -> &'static (GgmlType, u32, usize, usize) {
        // TABLE lists the variants in declaration order, so the discriminant is the row index
        // (`table_is_in_declaration_order` proves it).
        &TABLE[self as usize]
    }

    /// The numeric id stored in a GGUF tensor table.
    pub fn id(self) -> u32 {
        self.row().1
    }

    /// Elements per block (1 for the plain types).
    pub fn block_size(self) -> usize {
        self.row().2
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.row().3
    }

    /// Bytes that `n_elements` elements occupy, or `None` when `n_elements` is not a whole number
    /// of blocks or the size overflows `u64`.
    pub fn byte_len(self, n_elements: u64) -> Option<u64> {
        let block = self.block_size() as u64;
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(self.type_size() as u64)
    }

    /// The spec's name for the type (`"Q4_K"`, `"BF16"`, …).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
            NVFP4 => "NVFP4",
            Q1_0 => "Q1_0",
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_in_declaration_order() {
        for (index, row) in TABLE.iter().enumerate() {
            assert_eq!(row.0 as usize, index, "{}", row.0);
        }
    }

    #[test]
    fn every_row_round_trips_through_its_id() {
        for &(ty, id, block, size) in &TABLE {
            assert_eq!(GgmlType::from_id(id), Some(ty));
            assert_eq!(ty.id(), id);
            assert_eq!((ty.block_size(), ty.type_size()), (block, size), "{ty}");
        }
        let mut ids: Vec<u32> = TABLE.iter().map(|row| row.1).collect();
        ids.dedup();
        assert_eq!(ids.len(), TABLE.len(), "ids are unique and sorted");
    }

    #[test]
    fn retired_ids_are_unknown() {
        for id in [4, 5, 31, 32, 33, 36, 37, 38, 42, u32::MAX] {
            assert_eq!(GgmlType::from_id(id), None, "{id}");
        }
    }

    #[test]
    fn byte_len_needs_whole_blocks() {
        assert_eq!(GgmlType::Q4_K.byte_len(512), Some(288));
        assert_eq!(GgmlType::Q4_K.byte_len(100), None);
        assert_eq!(GgmlType::F32.byte_len(u64::MAX), None);
        assert_eq!(GgmlType::BF16.byte_len(3), Some(6));
    }
}
